"""4-bit weights for CPU decoding (`--cpu-weights int4`).

CPU decode is memory-bound: every token reads every weight. Kept as 4-bit groups of 32 (a scale and a zero
point per group, PyTorch's int4 weight-only matmul) the projections and the output matrix read ~7x fewer bytes
than float32. Activations, scales and zero points go through the kernel in bfloat16, so results differ from
float32 by about 1% (llama.cpp's quantised CPU kernels round activations to 8 bits for the same reason). A
Q4_0/Q4_1 GGUF's weights already lie on such a grid, so the 4-bit codes themselves are the file's.
"""

from __future__ import annotations

import torch

GROUP = 32


def available() -> bool:
    """Whether this torch build has the CPU int4 kernels."""
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(ops, "_convert_weight_to_int4pack_for_cpu")


def can_quantize(w: torch.Tensor) -> bool:
    # The packing kernel takes whole groups along `in` and rows in multiples of 16.
    return w.dim() == 2 and w.device.type == "cpu" and w.shape[1] % GROUP == 0 and w.shape[0] % 16 == 0


class Int4Weight:
    """A [out, in] weight as 4-bit groups along `in`; calling it computes x @ w.T."""

    def __init__(self, w: torch.Tensor) -> None:
        assert can_quantize(w), tuple(w.shape)
        n, k = w.shape
        groups = w.float().view(n, k // GROUP, GROUP)
        low, high = torch.aminmax(groups, dim=-1, keepdim=True)
        scale = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny)
        # In place after the first op: at start-up this runs over every projection weight (~135M values).
        q = (groups - low).div_(scale).round_().clamp_(0, 15).to(torch.int32).view(n, k)
        # The kernel reconstructs (q - 8) * scale + zero.
        zero = low + 8 * scale
        self.scales_zeros = torch.stack((scale.squeeze(-1), zero.squeeze(-1)), dim=-1).transpose(0, 1)
        self.scales_zeros = self.scales_zeros.contiguous().to(torch.bfloat16)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        self.shape = (n, k)
        self.dtype = w.dtype
        self.device = w.device

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_zeros.nbytes

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """x @ w.T as the kernel returns it, in bfloat16: callers that add it to a float32 tensor or write it
        into one skip a conversion (bfloat16 -> float32 is exact, so the values are those of __call__)."""
        if x.dtype != torch.bfloat16 or not x.is_contiguous():
            x = x.contiguous().to(torch.bfloat16)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_zeros)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.mm(x).to(x.dtype)


def quantize_model(model: torch.nn.Module) -> tuple[int, int]:
    """Replace the projection and output weights of a CPU model by Int4Weight; returns (bytes before, after)."""
    before = after = 0
    targets = [(layer, name) for layer in model.layers for name in ("wqkv", "wo", "w_gate_up", "w_down")]
    targets.append((model, "lm_head"))
    for owner, name in targets:
        w = getattr(owner, name)
        if not isinstance(w, torch.Tensor) or not can_quantize(w):
            continue
        q = Int4Weight(w)
        before += w.nbytes
        after += q.nbytes
        owner._buffers.pop(name, None)
        object.__setattr__(owner, name, q)
    return before, after
