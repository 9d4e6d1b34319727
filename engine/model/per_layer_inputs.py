"""Gemma 4's per-layer input embeddings (PLE): what each layer adds after its MLP, as transformers computes it.

Before the first layer, each token gets a [n_layers, width] input: its row of a second, narrow embedding
table (times sqrt(width)) plus the RMS-normalised projection of its main embedding (times hidden^-1/2), the
sum times 2^-1/2. Each layer then adds norm(proj(gelu(gate(x)) * input)) to the residual, before its scalar.
Both depend on the token alone (not on its position or the tokens before it), so nothing of it is kept
between steps: a restored conversation's K/V is all a continuation needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.model.norms import rms_norm
from engine.model.projections import linear

if TYPE_CHECKING:  # llama imports this module
    from engine.model.decoder_layer import DecoderLayer


class PerLayerInputs(torch.nn.Module):
    """The model-wide tensors of the per-layer inputs: the table in host RAM, the rest on the first stage's device."""

    table: torch.Tensor
    projection: torch.Tensor
    norm: torch.Tensor

    def __init__(self, table: torch.Tensor, projection: torch.Tensor, norm: torch.Tensor, n_layers: int,
                 eps: float) -> None:
        super().__init__()
        width = norm.shape[0]
        assert table.shape[1] == n_layers * width, ("per-layer table", tuple(table.shape), n_layers, width)
        assert projection.shape[0] == n_layers * width, ("per-layer projection", tuple(projection.shape))
        self.register_buffer("table", table, persistent=False)
        self.register_buffer("projection", projection, persistent=False)
        self.register_buffer("norm", norm, persistent=False)
        self.n_layers, self.width, self.eps = n_layers, width, eps
        # Scaled in the weights' dtype, as transformers' scaled embedding does.
        self.table_scale = torch.tensor(width**0.5, dtype=table.dtype)

    def forward(self, ids: torch.Tensor, x: torch.Tensor, n_single: int, fast: bool) -> torch.Tensor:
        """[tokens, n_layers, width] for token ids `ids` whose (scaled) embeddings are `x`."""
        if int(ids.max()) >= self.table.shape[0]:
            raise ValueError(f"token id {int(ids.max())} is past the per-layer table's {self.table.shape[0]} rows")
        rows = self.table[ids.to(self.table.device)] * self.table_scale  # scaled where the table is, then moved
        token = rows.to(x.device).view(-1, self.n_layers, self.width)
        projected = linear(x, self.projection, n_single, fast=fast) * x.new_tensor(x.shape[-1] ** -0.5)
        projected = rms_norm(projected.view(-1, self.n_layers, self.width), self.norm, self.eps)
        return (projected + token.to(projected.dtype)) * projected.new_tensor(2**-0.5)


def per_layer_residual(layer: DecoderLayer, x: torch.Tensor, per_layer: torch.Tensor | None, n_single: int,
                       fast: bool) -> torch.Tensor:
    """The end of a Gemma 4 layer: the per-layer input's gated residual, then the layer's scalar; `x` as it is
    for a layer without them."""
    if per_layer is not None:
        assert layer.ple_gate is not None and layer.ple_proj is not None and layer.ple_norm is not None
        h = F.gelu(linear(x, layer.ple_gate, n_single, fast=fast).to(x.dtype), approximate="tanh") * per_layer
        h = rms_norm(linear(h, layer.ple_proj, n_single, fast=fast).to(x.dtype), layer.ple_norm, layer.spec.norm.eps)
        x = x + h
    if layer.layer_scalar is not None:
        x = x * layer.layer_scalar
    return x
