"""`--cpu-weights int4` on hybrid models: their large projections as 4-bit groups (engine.model.int4).

Quantised, where the CPU kernel can pack them (`int4.can_quantize`): an attention mixer's `wqkv` and `wo`, a
recurrent mixer's input and output projections (`w_in`, `w_out`: plain [out, in] matmuls in the short-conv,
gated-DeltaNet and Mamba-2 mixers), a layer's dense MLP (`w_gate_up`, `w_down`) and the output matrix. Left as
they are: norms, convolutions, A / D / dt parameters, biases (small, or not matmuls), the embedding, and routed or
shared experts (they have their own placement and format, engine/model/moe_placement.py).

The recurrent mixers compute in float32 around their projections (convolution, scan, gates), so every hybrid
projection returns the activations' dtype (`Float32Int4Weight`) instead of the kernel's bfloat16: the same
values (bfloat16 -> float32 is exact), with a mixer seeing the dtypes its float weights give it.
"""

from __future__ import annotations

import torch

from engine.model import int4

MIXER_WEIGHTS = ("wqkv", "wo", "w_in", "w_out")
LAYER_WEIGHTS = ("w_gate_up", "w_down")


class Float32Int4Weight(int4.Int4Weight):
    """An Int4Weight whose product comes back in x's dtype (see the module docstring). A row count the packing
    kernel does not take (a Mamba-2 input projection ends with one row per head) is padded with zero rows, which
    the product drops again."""

    def __init__(self, w: torch.Tensor) -> None:
        rows = w.shape[0]
        pad = -rows % ROW_MULTIPLE
        super().__init__(torch.cat((w, w.new_zeros(pad, w.shape[1]))) if pad else w)
        self.rows = rows
        self.shape = tuple(w.shape)

    @classmethod
    def from_table_groups(cls, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> Float32Int4Weight:
        """From 4-bit groups of a [rows, in] table (a kept embedding's, quant_embedding.QuantEmbedding.int4_groups),
        padded with zero rows as __init__ pads a float weight (their groups: scale 0, minimum 0)."""
        rows, cols = codes.shape
        pad = -rows % ROW_MULTIPLE
        if pad:
            codes = torch.cat((codes, codes.new_zeros(pad, cols)))
            scale, minimum = (torch.cat((t, t.new_zeros(pad, t.shape[1]))) for t in (scale, minimum))
        self = cls.from_groups(codes, scale, minimum)
        self.rows, self.shape = rows, (rows, cols)
        return self

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        y = super().mm(x)
        return (y[:, : self.rows] if y.shape[1] != self.rows else y).to(x.dtype)


ROW_MULTIPLE = 16  # the packing kernel's (int4.can_pack)


def can_quantize(w: torch.Tensor) -> bool:
    return w.dim() == 2 and w.device.type == "cpu" and w.dtype == torch.float32 and int4.can_pack(
        w.shape[0] + -w.shape[0] % ROW_MULTIPLE, w.shape[1])


def _quantize(owner: torch.nn.Module, names: tuple[str, ...]) -> tuple[int, int]:
    before = after = 0
    for name in names:
        w = getattr(owner, name, None)
        if not isinstance(w, torch.Tensor) or not can_quantize(w):
            continue
        q = Float32Int4Weight(w)
        before, after = before + w.nbytes, after + q.nbytes
        int4.install(owner, name, q)
    return before, after


def quantize_layer(layer: torch.nn.Module) -> tuple[int, int]:
    """A built hybrid layer's projections as 4-bit groups; returns (bytes before, after)."""
    mixer = getattr(layer, "mixer", None)
    # Falcon-H1's parallel mixer holds its Mamba-2 and attention mixers as children
    mixers = [] if mixer is None else [mixer, *mixer.children()]
    sizes = [_quantize(m, MIXER_WEIGHTS) for m in mixers] + [_quantize(layer, LAYER_WEIGHTS)]
    return sum(b for b, _ in sizes), sum(a for _, a in sizes)


def quantize_head(model: torch.nn.Module) -> tuple[int, int]:
    """The output matrix as 4-bit groups (a tied one too: the embedding keeps its float rows)."""
    return _quantize(model, ("lm_head",))
