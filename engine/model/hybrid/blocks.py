"""Hybrid layers whose parts vary per layer: at most one token mixer and at most one feed-forward part, each
behind its own RMSNorm and residual.

- Nemotron-H: every layer is exactly one block (a Mamba-2 mixer, an attention mixer or a feed-forward), with one
  norm; its feed-forward is ungated, down(relu(up x)^2).
- Nemotron-H's MoE blocks: `engine.model.hybrid.nemotron_moe.NemotronMoe` as the feed-forward part.
- Granite-4.0-H with experts: the mixer, then the routed experts (`engine.model.moe.SparseMoe`, Granite's top-k
  softmax routing) plus the always-on shared SwiGLU MLP, the sum scaled by the residual multiplier.

`HybridCausalLM` runs a `BlockLayer` through its own `forward`; `engine.model.hybrid.model.HybridLayer` stays
the fixed "mixer, then SwiGLU MLP" layer of the other families. The dense weights sit on the layer as
`w_gate_up` (`w_up` rows for an ungated MLP) and `w_down`, and the experts as `moe`, the names
`engine.model.int4.quantize_model` looks for.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.hybrid.batch import Batch
from engine.model.hybrid.config import LAYER_KINDS, MLP
from engine.model.hybrid.nemotron_moe import NemotronMoe
from engine.model.int4 import Int4Weight
from engine.model.llama import rms_norm
from engine.model.moe import SparseMoe
from engine.model.projections import linear

ACTIVATIONS = ("swiglu", "relu2")


class BlockLayer(torch.nn.Module):
    """[norm -> mixer -> residual] then [norm -> dense MLP and/or experts -> residual]; either part may be absent."""

    # The buffers registered in __init__, typed (nn.Module's attribute lookup is typed Tensor | Module);
    # int4.quantize_model replaces the projection weights by Int4Weight ones.
    mixer_norm: torch.Tensor | None
    mlp_norm: torch.Tensor | None
    w_gate_up: torch.Tensor | Int4Weight | None
    w_down: torch.Tensor | Int4Weight | None

    def __init__(
        self, kind: str, mixer: torch.nn.Module | None, *, eps: float, mixer_norm: torch.Tensor | None = None,
        mlp_norm: torch.Tensor | None = None, w_gate_up: torch.Tensor | None = None,
        w_down: torch.Tensor | None = None, moe: SparseMoe | NemotronMoe | None = None, act: str = "swiglu",
        residual_multiplier: float = 1.0,
    ) -> None:
        super().__init__()
        assert kind in LAYER_KINDS and act in ACTIVATIONS, (kind, act)
        assert (mixer is None) == (mixer_norm is None) == (kind == MLP), "a mixer comes with its norm, MLP layers have none"
        has_dense = w_down is not None
        assert (w_gate_up is None) == (not has_dense), "the dense MLP needs both matrices"
        assert (mlp_norm is not None) == (has_dense or moe is not None), "a feed-forward part comes with its norm"
        assert mixer is not None or mlp_norm is not None, "a layer needs a mixer or a feed-forward part"
        if has_dense:
            assert w_gate_up is not None and w_down is not None  # has_dense (asserted above)
            rows = (2 if act == "swiglu" else 1) * w_down.shape[1]
            assert w_gate_up.shape[0] == rows, ("w_gate_up", tuple(w_gate_up.shape), tuple(w_down.shape))
        self.kind, self.act, self.eps, self.residual_multiplier = kind, act, eps, residual_multiplier
        self.mixer = mixer
        self.moe = moe
        self.register_buffer("mixer_norm", mixer_norm, persistent=False)
        self.register_buffer("mlp_norm", mlp_norm, persistent=False)
        self.register_buffer("w_gate_up", w_gate_up, persistent=False)
        self.register_buffer("w_down", w_down, persistent=False)

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        if self.mixer is not None:
            assert self.mixer_norm is not None  # comes with the mixer (asserted in __init__)
            x = self._residual(x, self.mixer(rms_norm(x, self.mixer_norm, self.eps), batch))
        if self.mlp_norm is not None:
            h = rms_norm(x, self.mlp_norm, self.eps)
            y = self._dense(h, batch.n_single) if self.w_down is not None else None
            if self.moe is not None:
                routed = self.moe(h, batch.n_single)
                y = routed if y is None else routed + y  # transformers adds the shared MLP to the experts' sum
            assert y is not None  # a feed-forward part exists (asserted in __init__)
            x = self._residual(x, y)
        return x

    def _dense(self, h: torch.Tensor, n_single: int) -> torch.Tensor:
        assert self.w_gate_up is not None and self.w_down is not None
        up = linear(h, self.w_gate_up, n_single)
        if self.act == "relu2":
            return linear(torch.square(F.relu(up)), self.w_down, n_single)
        inter = up.shape[1] // 2
        return linear(F.silu(up[:, :inter]) * up[:, inter:], self.w_down, n_single)

    def _residual(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + y * self.residual_multiplier if self.residual_multiplier != 1.0 else x + y
