"""4-bit weights for CPU decoding (`--cpu-weights int4`).

CPU decode is memory-bound: every token reads every weight. Kept as 4-bit groups of 32 (a scale and a zero
point per group, PyTorch's int4 weight-only matmul) the projections and the output matrix read ~7x fewer bytes
than float32. Activations, scales and zero points go through the kernel in bfloat16, so results differ from
float32 by about 1% (llama.cpp's quantised CPU kernels round activations to 8 bits for the same reason). A
Q4_0/Q4_1 GGUF's weights already lie on such a grid, so the 4-bit codes themselves are the file's.
"""

from __future__ import annotations

import functools
import time
from typing import Self, cast

import torch

from engine.model.heap import release_freed_memory

GROUP = 32
# A weight as 4-bit groups: (codes uint8 [..., out, in] in 0..15, scale, minimum [..., out, in // GROUP]), value =
# scale * code + minimum; what Int4Weight.from_groups takes and a Q4_0 / Q4_1 / Q4_K GGUF tensor holds.
Groups = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
# Rows quantised and packed at a time; a multiple of the packing kernel's blocks of 64 rows, so that packing
# row slices gives the same bytes as packing the whole matrix (tests/test_int4_weights.py checks it).
_ROWS = 1024


def available() -> bool:
    """Whether this torch build has the CPU int4 kernels."""
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(ops, "_convert_weight_to_int4pack_for_cpu")


# How much slower than a float32 matmul the 4-bit kernel may run on weights in cache and still be chosen by
# `--cpu-weights auto`: decode streams weights from memory, where 4-bit groups read ~7x fewer bytes. Measured on
# a 1x1024 @ 1024x1024 product (one thread): AVX-512 0.68x, AVX2 1.35x, and 29x where PyTorch has no vectorised
# kernel (its scalar fallback: ATEN_CPU_CAPABILITY=default, and every MSVC build, i.e. PyTorch on Windows).
SLOWER_LIMIT = 4.0


@functools.cache
def kernel_slowdown() -> float:
    """Time of the 4-bit kernel over float32's for one decode-shaped product on one thread (best of 8 each),
    measured once per process: ~1 with a vectorised kernel, tens of times more with the scalar fallback."""
    assert available()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        as_float, as_int4 = _time_products(1024, 1024)
    finally:
        torch.set_num_threads(threads)
        release_freed_memory()  # the probe's ~9 MB would otherwise stay in the heap
    return as_int4 / as_float


def _time_products(n: int, k: int) -> tuple[float, float]:
    """Seconds of x @ w.T for one row, [n, k] weights: float32, then 4-bit groups."""
    w = torch.full((n, k), 0.5)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.full((n, k), 7, dtype=torch.int32), 1)
    scales_zeros = torch.full((k // GROUP, n, 2), 0.25, dtype=torch.bfloat16)
    x = torch.full((1, k), 0.5)
    xb = x.to(torch.bfloat16)
    return (_best(lambda: torch.nn.functional.linear(x, w)),
            _best(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, GROUP, scales_zeros)))


def _best(run, rounds: int = 8) -> float:
    run()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t)
    return max(best, 1e-9)


def fast_here() -> bool:
    """Whether this PyTorch build's 4-bit CPU kernel is vectorised on this CPU (kernel_slowdown within
    SLOWER_LIMIT); without one, float32 weights decode several times faster."""
    return available() and kernel_slowdown() <= SLOWER_LIMIT


def can_pack(rows: int, cols: int) -> bool:
    # The packing kernel takes whole groups along `in` and rows in multiples of 16.
    return cols % GROUP == 0 and rows % 16 == 0


def can_quantize(w: torch.Tensor) -> bool:
    return w.dim() == 2 and w.device.type == "cpu" and can_pack(*w.shape)


def quantize_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A float [out, in] weight as (codes uint8 [out, in] in 0..15, scale, minimum [out, in // GROUP]), each
    group's codes spanning its own minimum to maximum; value ~ scale * code + minimum. Computed _ROWS rows at a
    time, so the temporaries stay small next to an output matrix."""
    n, k = w.shape
    codes = torch.empty(n, k, dtype=torch.uint8)
    scales, lows = torch.empty(n, k // GROUP), torch.empty(n, k // GROUP)
    for a in range(0, n, _ROWS):
        groups = w[a : a + _ROWS].float().view(-1, k // GROUP, GROUP)
        low = groups.amin(-1, keepdim=True)
        high = groups.amax(-1, keepdim=True)
        scale = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny)
        codes[a : a + _ROWS] = ((groups - low) / scale).round().clamp(0, 15).view(-1, k)
        scales[a : a + _ROWS], lows[a : a + _ROWS] = scale.squeeze(-1), low.squeeze(-1)
    return codes, scales, lows


class Int4Weight:
    """A [out, in] weight as 4-bit groups along `in`; calling it computes x @ w.T."""

    def __init__(self, w: torch.Tensor) -> None:
        assert can_quantize(w), tuple(w.shape)
        self._pack(*quantize_groups(w), w.dtype)

    @classmethod
    def from_groups(
        cls, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, dtype: torch.dtype = torch.float32
    ) -> Self:
        """From 4-bit codes [out, in] (0..15) with one scale and minimum per group of GROUP values along `in`
        ([out, in // GROUP]; value = scale * code + minimum), e.g. a Q4_0 / Q4_1 / Q4_K GGUF tensor's own."""
        n, k = codes.shape
        assert can_pack(n, k) and scale.shape == minimum.shape == (n, k // GROUP), (codes.shape, scale.shape)
        self = cls.__new__(cls)
        self._pack(codes, scale.float(), minimum.float(), dtype)
        return self

    @classmethod
    def from_packed(
        cls, packed: torch.Tensor, scales_zeros: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype = torch.float32
    ) -> Self:
        """From what `packed` and `scales_zeros` held after an earlier packing (engine/model/weights_cache.py)."""
        n, k = shape
        assert can_pack(n, k), shape
        if packed.dtype != torch.uint8 or tuple(packed.shape) != (n, k // 2):
            raise ValueError(f"packed 4-bit weight: expected uint8 {(n, k // 2)}, got {packed.dtype} {tuple(packed.shape)}")
        if scales_zeros.dtype != torch.bfloat16 or tuple(scales_zeros.shape) != (k // GROUP, n, 2):
            raise ValueError(f"4-bit scales: expected bfloat16 {(k // GROUP, n, 2)}, got {scales_zeros.dtype} "
                             f"{tuple(scales_zeros.shape)}")
        self = cls.__new__(cls)
        self.packed, self.scales_zeros = packed, scales_zeros
        self.shape, self.dtype, self.device = (n, k), dtype, packed.device
        return self

    def _pack(self, q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, dtype: torch.dtype) -> None:
        # The kernel reconstructs (q - 8) * scale + zero.
        zero = low + 8 * scale
        self.scales_zeros = torch.stack((scale, zero), dim=-1).transpose(0, 1)
        self.scales_zeros = self.scales_zeros.contiguous().to(torch.bfloat16)
        pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu  # takes int32 codes
        self.packed = torch.cat([pack(q[a : a + _ROWS].to(torch.int32), 1) for a in range(0, q.shape[0], _ROWS)])
        self.shape = tuple(q.shape)
        self.dtype = dtype
        self.device = q.device

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
    layers = cast(torch.nn.ModuleList, model.layers)  # CausalLM and HybridCausalLM both hold a ModuleList
    targets = [(layer, name) for layer in layers for name in ("wqkv", "wo", "w_gate_up", "w_down")]
    targets.append((model, "lm_head"))
    for owner, name in targets:
        w = getattr(owner, name)
        if not isinstance(w, torch.Tensor) or not can_quantize(w):
            continue
        q = Int4Weight(w)
        before += w.nbytes
        after += q.nbytes
        install(owner, name, q)
    for layer in layers:  # mixture-of-experts layers: the experts (engine/model/moe.py)
        moe = getattr(layer, "moe", None)  # a SparseMoe or None (dense layers)
        if moe is not None:
            b, a = moe.quantize_experts()
            before, after = before + b, after + a
    return before, after


def install(owner: torch.nn.Module, name: str, weight: object) -> None:
    """Put `weight` (an Int4Weight, a quant_embedding.QuantEmbedding) where the module keeps its tensor buffer
    `name` (a module cannot register it as one)."""
    owner._buffers.pop(name, None)
    object.__setattr__(owner, name, weight)
