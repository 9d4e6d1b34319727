"""Gemma 4's expert block (`enable_moe_block`, the 26B-A4B model): experts beside the dense MLP, not instead of it.

As transformers computes it: the router reads the layer's residual stream (RMS-normalised, times its own
`scale` and hidden^-1/2: one norm weight here), softmax over the experts in float32, the top k renormalised,
each weight times its expert's `per_expert_scale`; the chosen experts (GeGLU with the tanh GeLU, fused gate and
up rows) run on the residual through their own input norm; the dense MLP's output and the experts' each get
their own output norm and are summed before the layer's post-MLP norm. The experts run through moe.py's
`grouped_experts` (each chosen expert once over its rows, summed in expert order as transformers does).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.moe import grouped_experts
from engine.model.norms import rms_norm
from engine.model.projections import linear


class Gemma4Experts(torch.nn.Module):
    """Router, experts and the three norms of one Gemma 4 expert block."""

    router_norm: torch.Tensor
    router: torch.Tensor
    expert_scale: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    pre_norm: torch.Tensor
    post_mlp_norm: torch.Tensor
    post_experts_norm: torch.Tensor

    def __init__(self, *, top_k: int, eps: float, router: torch.Tensor, router_scale: torch.Tensor,
                 expert_scale: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, pre_norm: torch.Tensor,
                 post_mlp_norm: torch.Tensor, post_experts_norm: torch.Tensor) -> None:
        super().__init__()
        n_experts, hidden = router.shape
        inter = down.shape[2]
        assert 0 < top_k <= n_experts, (top_k, n_experts)
        assert router_scale.shape == (hidden,) and expert_scale.shape == (n_experts,), "router scales"
        assert gate_up.shape == (n_experts, 2 * inter, hidden) and down.shape == (n_experts, hidden, inter), (
            "experts", tuple(gate_up.shape), tuple(down.shape))
        self.top_k, self.eps, self.n_experts = top_k, eps, n_experts
        # norm(x) * scale * hidden^-1/2 is one RMSNorm whose weight is scale * hidden^-1/2.
        self.register_buffer("router_norm", router_scale * hidden**-0.5, persistent=False)
        for name, t in (("router", router), ("expert_scale", expert_scale.float()), ("gate_up", gate_up),
                        ("down", down), ("pre_norm", pre_norm), ("post_mlp_norm", post_mlp_norm),
                        ("post_experts_norm", post_experts_norm)):
            self.register_buffer(name, t, persistent=False)

    def forward(self, x: torch.Tensor, mlp_out: torch.Tensor, n_single: int, fast: bool) -> torch.Tensor:
        """The sum of the dense MLP's output `mlp_out` and the experts' on the residual `x`, each normalised."""
        logits = linear(rms_norm(x, self.router_norm, self.eps), self.router, n_single, fast=fast)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True) * self.expert_scale[experts]
        h = rms_norm(x, self.pre_norm, self.eps)
        out = grouped_experts(h, experts, weights.to(h.dtype), n_single, self.n_experts, self._expert)
        return (rms_norm(mlp_out.to(x.dtype), self.post_mlp_norm, self.eps)
                + rms_norm(out, self.post_experts_norm, self.eps))

    def _expert(self, x: torch.Tensor, e: int, n_one: int) -> torch.Tensor:
        gu = linear(x, self.gate_up[e], n_one)
        inter = gu.shape[1] // 2
        return linear(F.gelu(gu[:, :inter], approximate="tanh") * gu[:, inter:], self.down[e], n_one)
