"""The expert settings of Nemotron-H's mixture-of-experts blocks (kept apart so config.py stays light)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class NemotronExperts:
    """The expert settings of a Nemotron-H MoE model; part of its identity (`HybridConfig.nemotron_experts`)."""

    layers: tuple[int, ...]  # the MoE blocks
    n_experts: int
    top_k: int
    expert_size: int
    shared_size: int
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    scaling: float = 1.0
    latent_size: int = 0  # 0: the experts read and write the hidden size

    def check(self) -> None:
        """ValueError saying what is wrong."""
        for name in ("n_experts", "top_k", "expert_size", "shared_size", "n_group", "topk_group"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: expected a positive whole number, got {value!r}")
        if self.n_experts % self.n_group or self.topk_group > self.n_group:
            raise ValueError(f"n_group {self.n_group} / topk_group {self.topk_group} do not split {self.n_experts} experts")
        if self.top_k > self.n_experts // self.n_group * self.topk_group:
            raise ValueError(f"num_experts_per_tok {self.top_k} exceeds the experts of the chosen groups")
