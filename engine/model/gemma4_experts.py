"""Gemma 4's expert block (`enable_moe_block`, the 26B-A4B model): experts beside the dense MLP, not instead of it.

As transformers computes it: the router reads the layer's residual stream (RMS-normalised, times its own
`scale` and hidden^-1/2: one norm weight here), softmax over the experts in float32, the top k renormalised,
each weight times its expert's `per_expert_scale`; the chosen experts (GeGLU with the tanh GeLU, fused gate and
up rows) run on the residual through their own input norm; the dense MLP's output and the experts' each get
their own output norm and are summed before the layer's post-MLP norm.

The router and the experts are the shared block's (moe.py's SparseMoe, built by moe_loading.build_sparse_moe
from the canonical "i.router", "i.experts.gate_up", "i.experts.down"), so the experts live where `--moe-experts`
places them (host RAM as 4-bit groups, or a GGUF's own blocks) and are counted in the expert arena like every
MoE family's. What differs is said here: the router's own input norm, the per-expert scale, and
the experts' input norm (SparseMoe routes from its input; here the router and the experts read two norms of x).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model import moe as moe_block
from engine.model.moe import SparseMoe
from engine.model.moe_config import MoeConfig
from engine.model.norms import rms_norm
from engine.model.projections import linear


def routed_config(parallel_experts: tuple[int, int, int]) -> MoeConfig:
    """The shared block's settings for ModelConfig.parallel_experts (experts, top k, expert width): softmax over
    the experts, the top k renormalised, GeGLU experts."""
    n_experts, top_k, expert_size = parallel_experts
    return MoeConfig(n_experts=n_experts, top_k=top_k, expert_size=expert_size, routing="softmax_topk",
                     norm_topk_prob=True, activation="gelu_tanh")


@dataclass(frozen=True)
class ExpertShape:
    """What moe_loading.build_sparse_moe reads of a model with the block beside every layer's MLP (its MoeShape)."""

    moe: MoeConfig
    hidden_size: int

    def is_moe_layer(self, index: int) -> bool:  # every Gemma 4 layer has the block when the model has one
        return index >= 0


class Gemma4Experts(torch.nn.Module):
    """The shared expert block (router and experts) and Gemma 4's scales and three norms around it."""

    router_norm: torch.Tensor
    expert_scale: torch.Tensor
    pre_norm: torch.Tensor
    post_mlp_norm: torch.Tensor
    post_experts_norm: torch.Tensor

    def __init__(self, *, routed: SparseMoe, eps: float, router_scale: torch.Tensor, expert_scale: torch.Tensor,
                 pre_norm: torch.Tensor, post_mlp_norm: torch.Tensor, post_experts_norm: torch.Tensor) -> None:
        super().__init__()
        c = routed.config
        hidden = routed.router.shape[1]
        assert (c.routing, c.norm_topk_prob, c.shared_expert_size) == ("softmax_topk", True, 0), c
        assert router_scale.shape == (hidden,) and expert_scale.shape == (c.n_experts,), "router scales"
        self.moe, self.eps = routed, eps
        # norm(x) * scale * hidden^-1/2 is one RMSNorm whose weight is scale * hidden^-1/2.
        self.register_buffer("router_norm", router_scale * hidden**-0.5, persistent=False)
        for name, t in (("expert_scale", expert_scale.float()), ("pre_norm", pre_norm),
                        ("post_mlp_norm", post_mlp_norm), ("post_experts_norm", post_experts_norm)):
            self.register_buffer(name, t, persistent=False)

    def forward(self, x: torch.Tensor, mlp_out: torch.Tensor, n_single: int, fast: bool) -> torch.Tensor:
        """The sum of the dense MLP's output `mlp_out` and the experts' on the residual `x`, each normalised."""
        logits = linear(rms_norm(x, self.router_norm, self.eps), self.moe.router, n_single, fast=fast)
        weights, experts = moe_block.route(logits, self.moe.config)
        weights = weights * self.expert_scale[experts]
        out = self.moe.run_routed(rms_norm(x, self.pre_norm, self.eps), experts, weights, n_single, fast=fast)
        return (rms_norm(mlp_out.to(x.dtype), self.post_mlp_norm, self.eps)
                + rms_norm(out, self.post_experts_norm, self.eps))
