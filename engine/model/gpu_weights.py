"""4-bit weights on CUDA (`--gpu-weights int4`): PyTorch's own weight-only int4 matmul (tinygemm).

Batch-1 decode reads every weight once per token; as 4-bit groups of `GROUP` along `in` (a bfloat16 scale and
zero point per group) a projection reads ~3.8x fewer bytes than bf16. Measured on an H200 (docs/BENCHMARKS.md,
"4-bit weights on CUDA"): the kernel is 1.4-1.9x faster than bf16 at one row and 0.64-0.82x at eight; an
8B-shaped model decodes 1.38x faster at batch 1, 0.90x at batch 8, and prefills ~17x slower (the kernel is made
for few rows). So `auto` keeps bf16; int4 is for fitting a model into less memory and for one conversation.
Groups of 128 were the fastest of 32/64/128 there at the same kernel error (~3e-3 relative to the dequantised
weight). Weight-only int8 through `torch._weight_int8pack_mm` measured 0.05x of bf16 and is not offered.

The weights are quantised on the GPU after a bf16 load (the bf16 copy is freed layer by layer). CPU models keep
`engine.model.int4` (groups of 32, the CPU kernel) untouched; this class only swaps the CUDA kernel in.
"""

from __future__ import annotations

from typing import cast

import torch

from engine.model import int4

GROUP = 128
INNER_K_TILES = 8  # the packing layout tinygemm reads (torchao's default); needs `in` % (INNER_K_TILES * 16) == 0
CHOICES = ("auto", "bf16", "int4")


def available() -> bool:
    ops = torch.ops.aten
    return torch.cuda.is_available() and hasattr(ops, "_weight_int4pack_mm") and hasattr(
        ops, "_convert_weight_to_int4pack")


def can_pack(w: torch.Tensor) -> bool:
    n, k = w.shape if w.dim() == 2 else (0, 0)
    return w.device.type == "cuda" and n > 0 and k % GROUP == 0 and k % (INNER_K_TILES * 16) == 0 and n % 8 == 0


class CudaInt4Weight(int4.Int4Weight):
    """A CUDA [out, in] weight as 4-bit groups of GROUP along `in`; calling it computes x @ w.T in bfloat16."""

    def __init__(self, w: torch.Tensor) -> None:  # noqa: D107 - the base class's constructor, on CUDA
        assert can_pack(w), (tuple(w.shape), w.device)
        n, k = w.shape
        groups = w.float().view(n, k // GROUP, GROUP)
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        scale = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny)
        q = ((groups - low) / scale).round().clamp(0, 15).to(torch.int32).view(n, k)
        zero = (low + 8 * scale).squeeze(-1)  # the kernel reconstructs (q - 8) * scale + zero
        self.scales_zeros = torch.stack((scale.squeeze(-1), zero), dim=-1).transpose(0, 1).contiguous()
        self.scales_zeros = self.scales_zeros.to(torch.bfloat16)
        packed_bytes = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)  # two codes a byte, even one high
        self.packed = torch.ops.aten._convert_weight_to_int4pack(packed_bytes, INNER_K_TILES)
        self.shape = (n, k)
        self.dtype = torch.bfloat16
        self.device = w.device

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or not x.is_contiguous():
            x = x.contiguous().to(torch.bfloat16)
        return torch.ops.aten._weight_int4pack_mm(x, self.packed, GROUP, self.scales_zeros)


def resolve(choice: str, dtype: torch.dtype, on_cuda: bool) -> str:
    """The effective --gpu-weights ("bf16" or "int4"); ValueError when int4 cannot apply."""
    if choice not in CHOICES:
        raise ValueError(f"--gpu-weights {choice!r}: expected one of {', '.join(CHOICES)}")
    if choice != "int4":
        return "bf16"  # auto: bf16 (int4 is slower than bf16 for batched decode, see the module docstring)
    if not on_cuda:
        raise ValueError("--gpu-weights int4: only for models on a CUDA device (--devices cuda:N); on the CPU use "
                         "--cpu-weights int4")
    if dtype != torch.bfloat16:
        raise ValueError(f"--gpu-weights int4: needs --dtype bfloat16 (or auto), got {str(dtype).removeprefix('torch.')}")
    if not available():
        raise ValueError(f"--gpu-weights int4: this PyTorch ({torch.__version__}) has no CUDA int4 kernels")
    return "int4"


def quantize_model(model: torch.nn.Module) -> tuple[int, int]:
    """Replace a CUDA model's projection and output weights by CudaInt4Weight; returns (bytes before, after).
    Mixture-of-experts layers keep their experts as they are (their routing runs eagerly anyway)."""
    before = after = 0
    layers = cast(torch.nn.ModuleList, model.layers)
    targets = [(layer, name) for layer in layers for name in ("wqkv", "wo", "w_gate_up", "w_down")]
    targets.append((model, "lm_head"))
    for owner, name in targets:
        w = getattr(owner, name, None)
        if not isinstance(w, torch.Tensor) or not can_pack(w):
            continue
        q = CudaInt4Weight(w)
        before += w.nbytes
        after += q.nbytes
        int4.install(owner, name, q)
        del w
    torch.cuda.empty_cache()
    return before, after
