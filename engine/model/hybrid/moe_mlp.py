"""The mixture-of-experts MLP of hybrid families (Qwen3-Next, Qwen3.5-MoE): the existing sparse expert block
(engine/model/moe.py) in place of a layer's dense MLP, built from the same canonical keys as the attention-only
MoE families (engine/model/moe_loading.py), so `--moe-experts cpu` / `--moe-cpu-layers N` place a hybrid's routed
experts in host RAM as 4-bit groups exactly as they do for Qwen3-MoE.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.model.hybrid.config import HybridConfig
from engine.model.moe import SparseMoe
from engine.model.moe_loading import build_sparse_moe


def build(
    config: HybridConfig, layer: int, get: Callable[[str], torch.Tensor | None],
    need: Callable[[str, tuple[int, ...]], torch.Tensor], to: Callable[[torch.Tensor], torch.Tensor], path: str,
    dtype: torch.dtype, cpu_experts: frozenset[int],
) -> SparseMoe | None:
    """Layer `layer`'s expert block on the device `to` moves to (its routed experts in host RAM as 4-bit groups
    when the layer is in `cpu_experts`), or None when the layer has a dense MLP."""
    if not config.is_moe_layer(layer):
        return None
    on_host = layer in cpu_experts

    def to_host(t: torch.Tensor) -> torch.Tensor:  # experts placed in host RAM never visit the layer's device
        return t.to(device="cpu", dtype=dtype).contiguous()

    moe = build_sparse_moe(config, layer, get, need, to, path, to_experts=to_host if on_host else to)
    if on_host:
        moe.quantize_experts(shared=False)  # the shared expert runs where the layer runs, as it is
    return moe
