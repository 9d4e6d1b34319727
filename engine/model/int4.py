"""4-bit weights for CPU decoding (`--cpu-weights int4`).

CPU decode is memory-bound: every token reads every weight. Kept as 4-bit groups of 32 (a scale and a minimum per
group) the projections and the output matrix read ~7x fewer bytes than float32. A Q4_0/Q4_1 GGUF's weights
already lie on such a grid, so the 4-bit codes themselves are the file's.

Two kernels multiply them, one per process (`kernel()`):
- "blocks" (engine/model/kernels/blocks.c, shipped built for AVX-512, AVX2 and any other CPU): the file's own
  block layout with float16 scales and minimums, activations rounded to int16 per block of 32 and integer dot
  products; float32 out. On the bundled model its logits are within 0.05 % of float32 arithmetic on the same
  4-bit weights (8-bit activations, llama.cpp's choice, were 1-9 % away). ~2x PyTorch's kernel per decode
  product on AVX2, about even on AVX-512 (docs/BENCHMARKS.md).
- "aten" (PyTorch's `_weight_int4pack_mm_for_cpu`) elsewhere: its own packed layout, activations, scales and
  zero points in bfloat16, bfloat16 out: 0.2-2.7 % from float32 arithmetic on the bundled model.
Either way a row's result does not depend on the other rows of the call or the thread count.
"""

from __future__ import annotations

import functools
import time
from typing import Self, cast

import torch

from engine.model import kernels
from engine.model.heap import release_freed_memory

GROUP = 32
# A weight as 4-bit groups: (codes uint8 [..., out, in] in 0..15, scale, minimum [..., out, in // GROUP]), value =
# scale * code + minimum; what Int4Weight.from_groups takes and a Q4_0 / Q4_1 / Q4_K GGUF tensor holds.
Groups = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
# Rows quantised and packed at a time; a multiple of the packing kernel's blocks of 64 rows, so that packing
# row slices gives the same bytes as packing the whole matrix (tests/test_int4_weights.py checks it).
_ROWS = 1024


def _aten_available() -> bool:
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(ops, "_convert_weight_to_int4pack_for_cpu")


@functools.cache
def kernel() -> str | None:
    """This process's 4-bit CPU kernel: "blocks", "aten" or None (see the module docstring); chosen once, so
    every Int4Weight of a process has one layout. A fixed rule rather than a timing, so that a restarted engine
    keeps the kernel its parked conversations were computed with: the native one wherever it can run (with the
    native decode step it decodes faster than PyTorch's AVX-512 kernel too, engine/model/kernels), else
    PyTorch's."""
    aten = _aten_available()
    if kernels.choice() == "aten":
        return "aten" if aten else None
    if kernels.library() is not None:
        return "blocks"
    return "aten" if aten else None


def available() -> bool:
    """Whether 4-bit CPU weights can be multiplied here."""
    return kernel() is not None


def describe_kernel() -> str:
    """A line for logs and /health: which kernel, and why not the native one."""
    lib = kernels.library() if kernel() == "blocks" else None
    if lib is not None:
        return f"native ({lib.isa} build: integer dot products, int16 activations)"
    reason = kernels.unavailable_reason()
    return f"PyTorch's ({reason})" if reason else "PyTorch's"


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
    """Seconds of x @ w.T for one row, [n, k] weights: float32, then 4-bit groups through this process's kernel."""
    w = torch.linspace(-1, 1, n * k).view(n, k)
    q = Int4Weight(w)
    x = torch.full((1, k), 0.5)
    return _best(lambda: torch.nn.functional.linear(x, w)), _best(lambda: q.mm(x))


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


# The native kernel's layout: a GGUF Q4_1 block's bytes (float16 scale, float16 minimum, 16 bytes of codes), with
# the scales and minimums of each run of RUN blocks gathered before the run's codes, so that the kernel converts
# and scales a run's 8 blocks with one vector operation each (engine/model/kernels/blocks.c).
Q4_BLOCK_BYTES = 20
RUN = 8


def q4_runs(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """4-bit groups (codes uint8 [n, k] in 0..15, scale and minimum [n, k // GROUP]) in the native kernel's rows,
    uint8 [n, k // GROUP * Q4_BLOCK_BYTES]: each run of up to RUN blocks is its c float16 scales, its c float16
    minimums, then its c blocks of 16 code bytes (byte j of a block holds its value j low and value j + 16 high,
    as in a Q4_1 file). A scale or minimum beyond float16's range is refused (AssertionError): no GGUF or 4-bit
    group has one."""
    n, k = codes.shape
    nb = k // GROUP
    halves = (scale.to(torch.float16), minimum.to(torch.float16))
    assert all(h.isfinite().all() for h in halves), "4-bit scales beyond float16"
    pairs = codes.view(n, nb, 2, GROUP // 2)
    nibbles = pairs[:, :, 0] | (pairs[:, :, 1] << 4)
    rows = torch.empty(n, nb * Q4_BLOCK_BYTES, dtype=torch.uint8)
    for b0 in range(0, nb, RUN):
        c = min(RUN, nb - b0)
        run = rows[:, b0 * Q4_BLOCK_BYTES : (b0 + c) * Q4_BLOCK_BYTES]
        for i, h in enumerate(halves):
            run[:, 2 * c * i : 2 * c * (i + 1)] = h[:, b0 : b0 + c].contiguous().view(torch.uint8)
        run[:, 4 * c :] = nibbles[:, b0 : b0 + c].reshape(n, c * GROUP // 2)
    return rows


class Int4Weight:
    """A [out, in] weight as 4-bit groups along `in`; calling it computes x @ w.T. Its tensors are those of the
    process's kernel (`kernel()`): `blocks` (q4_runs) for "blocks", `packed` / `scales_zeros` for "aten"."""

    kernel = "aten"  # what CudaInt4Weight (engine/model/gpu_weights.py) keeps too

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
    def from_state(
        cls, state: dict[str, torch.Tensor], shape: tuple[int, int], dtype: torch.dtype = torch.float32
    ) -> Self:
        """From what `state()` returned in an earlier process with the same kernel (engine/model/weights_cache.py);
        ValueError when the tensors are not that kernel's for `shape`."""
        n, k = shape
        assert can_pack(n, k), shape
        expected = _state_layout(n, k)
        if set(state) != set(expected):
            raise ValueError(f"4-bit weight: expected the tensors {sorted(expected)}, got {sorted(state)}")
        for name, (want_dtype, want_shape) in expected.items():
            t = state[name]
            if t.dtype != want_dtype or tuple(t.shape) != want_shape:
                raise ValueError(f"4-bit weight {name}: expected {want_dtype} {want_shape}, got {t.dtype} "
                                 f"{tuple(t.shape)}")
        self = cls.__new__(cls)
        self.kernel = kernel() or "aten"
        for name, t in state.items():
            setattr(self, name, t)
        self.shape, self.dtype, self.device = (n, k), dtype, torch.device("cpu")
        return self

    def state(self) -> dict[str, torch.Tensor]:
        """The tensors that hold this weight (by attribute name), what from_state takes back."""
        n, k = self.shape
        return {name: getattr(self, name) for name in _state_layout(n, k, self.kernel)}

    def _pack(self, q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, dtype: torch.dtype) -> None:
        self.shape = tuple(q.shape)
        self.dtype = dtype
        self.device = q.device
        self.kernel = kernel() or "aten"
        n, k = q.shape
        if self.kernel == "blocks":
            self.blocks = q4_runs(q, scale, low)
            return
        # The aten kernel reconstructs (q - 8) * scale + zero.
        zero = low + 8 * scale
        self.scales_zeros = torch.stack((scale, zero), dim=-1).transpose(0, 1)
        self.scales_zeros = self.scales_zeros.contiguous().to(torch.bfloat16)
        pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu  # takes int32 codes
        self.packed = torch.cat([pack(q[a : a + _ROWS].to(torch.int32), 1) for a in range(0, n, _ROWS)])

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.state().values())

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """x @ w.T as the kernel returns it: float32 from "blocks"; bfloat16 from "aten", which callers that add
        it to a float32 tensor or write it into one keep (bfloat16 -> float32 is exact, so the values are those
        of __call__)."""
        if self.kernel == "blocks":
            return self._blocks_mm(x)
        if x.dtype != torch.bfloat16 or not x.is_contiguous():
            x = x.contiguous().to(torch.bfloat16)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_zeros)

    def _blocks_mm(self, x: torch.Tensor) -> torch.Tensor:
        q4_matmul = cast(kernels.Library, kernels.library()).q4_matmul
        n, k = self.shape
        return kernels.product(q4_matmul, x, (n, k), self.blocks)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.mm(x).to(x.dtype)


def _state_layout(n: int, k: int, kind: str | None = None) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The tensors (dtype, shape) an [n, k] Int4Weight holds with kernel `kind` (this process's by default)."""
    if (kind or kernel()) == "blocks":
        return {"blocks": (torch.uint8, (n, k // GROUP * Q4_BLOCK_BYTES))}
    return {"packed": (torch.uint8, (n, k // 2)), "scales_zeros": (torch.bfloat16, (k // GROUP, n, 2))}


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
    if name in dict(owner.named_buffers(recurse=False)):
        delattr(owner, name)  # Module.__delattr__ drops the buffer
    object.__setattr__(owner, name, weight)
