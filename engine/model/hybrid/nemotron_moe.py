"""Nemotron-H's mixture-of-experts blocks ("E" / moe; Nemotron-3 Nano): routed relu2 experts plus a shared one.

As transformers' NemotronHMoE computes them (float32 router):
    scores = sigmoid(router h); choice = scores + e_score_correction_bias
    the top `topk_group` of `n_group` expert groups (by the sum of each group's two best choice values), then the
    top-k experts by choice value within them; weights = their scores, divided by their sum (+1e-20) when
    `norm_topk_prob`, times `routed_scaling_factor`
    out = fc2(sum_k weight_k * down_k(relu(up_k fc1(h))^2)) + shared_down(relu(shared_up h)^2)
(fc1 / fc2 the optional latent projections, `moe_latent_size`). Experts are grouped as in `engine.model.moe`:
each chosen expert runs once over all its rows, and a row's result does not depend on its batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.hybrid.nemotron_config import NemotronExperts
from engine.model.moe import grouped_experts, keep_top_groups, sigmoid_rows
from engine.model.projections import linear


class NemotronMoe(torch.nn.Module):
    """Router (+ score-correction bias), stacked relu2 experts, the shared expert and the latent projections."""

    # The buffers registered in __init__, typed (nn.Module's attribute lookup is typed Tensor | Module).
    router: torch.Tensor
    score_bias: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    shared_up: torch.Tensor
    shared_down: torch.Tensor
    latent_in: torch.Tensor | None
    latent_out: torch.Tensor | None

    def __init__(
        self, settings: NemotronExperts, hidden_size: int, *, router: torch.Tensor, score_bias: torch.Tensor,
        up: torch.Tensor, down: torch.Tensor, shared_up: torch.Tensor, shared_down: torch.Tensor,
        latent_in: torch.Tensor | None = None, latent_out: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        s, h = settings, hidden_size
        width = s.latent_size or h
        assert router.shape == (s.n_experts, h) and score_bias.shape == (s.n_experts,), "router shape"
        assert router.dtype == score_bias.dtype == torch.float32, "the router runs in float32"
        assert up.shape == (s.n_experts, s.expert_size, width), ("up", tuple(up.shape))
        assert down.shape == (s.n_experts, width, s.expert_size), ("down", tuple(down.shape))
        assert shared_up.shape == (s.shared_size, h) and shared_down.shape == (h, s.shared_size), "shared expert"
        assert (latent_in is None) == (latent_out is None) == (not s.latent_size), "latent projections"
        if latent_in is not None:
            assert latent_out is not None  # they come in pairs (asserted above)
            assert latent_in.shape == (width, h) and latent_out.shape == (h, width), "latent projection shape"
        self.settings = s
        for name, t in (("router", router), ("score_bias", score_bias), ("up", up), ("down", down),
                        ("shared_up", shared_up), ("shared_down", shared_down), ("latent_in", latent_in),
                        ("latent_out", latent_out)):
            self.register_buffer(name, t, persistent=False)

    def route(self, h: torch.Tensor, n_single: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [tokens, k] float32, experts [tokens, k] int64) for the hidden rows `h`."""
        s = self.settings
        logits = linear(h.float(), self.router, n_single)
        scores = sigmoid_rows(logits)
        choice = scores + self.score_bias
        if s.n_group > 1:
            choice = keep_top_groups(choice, s.n_group, s.topk_group)
        experts = torch.topk(choice, k=s.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if s.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * s.scaling, experts

    def forward(self, h: torch.Tensor, n_single: int) -> torch.Tensor:
        weights, experts = self.route(h, n_single)
        x = linear(h, self.latent_in, n_single) if self.latent_in is not None else h
        out = grouped_experts(x, experts, weights.to(h.dtype), n_single, self.settings.n_experts,
                              lambda rows, e, n_one: _relu2_mlp(rows, self.up[e], self.down[e], n_one))
        if self.latent_out is not None:
            out = linear(out, self.latent_out, n_single)
        return out + _relu2_mlp(h, self.shared_up, self.shared_down, n_single)

    @property
    def expert_device(self) -> torch.device:
        """Where the routed experts' weights are (engine.model.moe_placement reads it of every layer's `moe`)."""
        return torch.device(self.up.device)

    @property
    def expert_bytes(self) -> int:
        return self.up.nbytes + self.down.nbytes


def _relu2_mlp(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, n_single: int) -> torch.Tensor:
    return linear(torch.square(F.relu(linear(x, up, n_single))), down, n_single)
