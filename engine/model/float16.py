"""16-bit weights for CPU decoding where the 4-bit kernel is not vectorised (`--cpu-weights float16`).

PyTorch compiles its vectorised 4-bit CPU kernel for AVX2 and AVX-512 only, and not at all under MSVC: PyTorch
for Windows runs a scalar loop, ~25x slower than a float32 product (engine/model/int4.py, kernel_slowdown).
There the projections and the output matrix are kept as float16 and multiplied by FBGEMM's fp16 GEMM (a part of
PyTorch's x86 Linux builds, with its own AVX2 / AVX-512 kernels chosen at run time; PyTorch 2.13.0+cpu for
Windows is built without FBGEMM: its quantized engines are ["onednn"], and the fp16 ops refuse with "This
PyTorch installation was not built with FBGEMM operators", seen under wine by scripts/windows-check.sh, so there
`available()` is False and `auto` keeps float32; the shipped native kernels make this path rare): half the bytes float32 reads a
token where `in` is a multiple of 512 (FBGEMM pads it to whole blocks: the bundled model's 576 columns take as
much memory as float32), float32 activations and accumulation, so logits stay within ~1e-3 of float32's (the weights' own float16
rounding) where 4-bit groups with bfloat16 activations are ~5e-2 away. Its rows do not depend on how many rows
share a call or on the thread count (tests/test_float16_weights.py checks both), so decode stays batch-invariant.

Measured on the bundled model, one thread, with the scalar 4-bit kernel forced (ATEN_CPU_CAPABILITY=default):
47 tok/s against 11.3 for float32 weights and 2.4 for 4-bit ones (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import cast

import torch

# The column block FBGEMM's fp16 packing pads `in` to (with its AVX-512 kernels; a smaller one with AVX2 makes
# nbytes an upper bound).
_PACKED_COLS = 512


@functools.cache
def available() -> bool:
    """Whether this PyTorch has FBGEMM's fp16 linear (x86 builds; not ARM ones)."""
    ops = torch.ops.quantized
    if not (hasattr(ops, "linear_prepack_fp16") and hasattr(ops, "linear_dynamic_fp16")):
        return False
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    try:  # a build can list the ops and still refuse them at run time
        packed = ops.linear_prepack_fp16(torch.ones(8, 8), None)
        return bool(torch.equal(ops.linear_dynamic_fp16(torch.ones(1, 8), packed), torch.full((1, 8), 8.0)))
    except RuntimeError:
        return False


class Float16Weight:
    """A float32 [out, in] weight kept as FBGEMM-packed float16; calling it computes x @ w.T in float32."""

    def __init__(self, w: torch.Tensor) -> None:
        assert w.dim() == 2 and w.device.type == "cpu" and w.dtype == torch.float32, (w.shape, w.device, w.dtype)
        self.packed = torch.ops.quantized.linear_prepack_fp16(w.contiguous(), None)
        self.shape = tuple(w.shape)
        self.dtype = torch.float32
        self.device = w.device

    @property
    def nbytes(self) -> int:
        """The packed matrix's size: FBGEMM pads `in` to whole blocks of _PACKED_COLS values (measured by RSS:
        1.78x the float16 bytes at 576 columns, 1.00x at 1024, 1536 and 4096)."""
        return self.shape[0] * -(-self.shape[1] // _PACKED_COLS) * _PACKED_COLS * 2

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """x @ w.T for float32 rows x [n, in] -> [n, out]."""
        return torch.ops.quantized.linear_dynamic_fp16(x.contiguous(), self.packed)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.mm(x)


# What a layer (dense, or a hybrid's mixer) multiplies through engine.model.projections.linear: attention, the
# recurrent mixers' input and output projections, the dense MLP. Experts (own format), norms, convolutions stay.
_PROJECTIONS = ("wqkv", "wo", "w_in", "w_out", "w_gate_up", "w_down")


def pack_model(model: torch.nn.Module) -> tuple[int, int]:
    """Replace the float32 CPU projection and output weights of a CausalLM or HybridCausalLM by Float16Weight; returns (bytes of
    the tensors replaced, bytes packed). A tied output matrix is packed too: the token embedding keeps the float32
    table (a step looks up one row of it). FBGEMM's packing (~13 ns a weight) releases the GIL, so tensors are
    packed on PyTorch's threads at once (1.7x on 2 cores for even sizes), at most two per thread in flight: each
    float32 tensor is freed once its packed copy is in place, so the load's peak stays a few tensors above the
    float32 model's."""
    from engine.model.heap import release_freed_memory
    from engine.model.int4 import install

    layers = cast(torch.nn.ModuleList, model.layers)
    owners: list[torch.nn.Module] = []
    for layer in layers:
        mixer = getattr(layer, "mixer", None)  # a hybrid layer's (Falcon-H1's parallel one holds two as children)
        owners += [layer] + ([] if mixer is None else [mixer, *mixer.children()])
    targets = [(owner, name) for owner in owners for name in _PROJECTIONS]
    targets.append((model, "lm_head"))
    targets = [(owner, name) for owner, name in targets if _packable(getattr(owner, name, None))]
    workers = max(1, torch.get_num_threads())
    sizes = [0, 0]  # bytes replaced, bytes packed
    pending: dict[Future[Float16Weight], tuple[torch.nn.Module, str]] = {}

    def put_in_place(futures: Iterable[Future[Float16Weight]]) -> None:
        for future in futures:
            owner, name = pending.pop(future)
            packed = future.result()
            sizes[0] += getattr(owner, name).nbytes
            sizes[1] += packed.nbytes
            install(owner, name, packed)

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="strata-pack") as pool:
        for owner, name in targets:
            pending[pool.submit(Float16Weight, getattr(owner, name))] = (owner, name)
            if len(pending) >= 2 * workers:
                put_in_place(wait(pending, return_when=FIRST_COMPLETED).done)
        put_in_place(list(pending))
    release_freed_memory()  # the float32 tensors' pages back to the system (glibc keeps them otherwise)
    return sizes[0], sizes[1]


def _packable(w: object) -> bool:
    return isinstance(w, torch.Tensor) and w.dim() == 2 and w.device.type == "cpu" and w.dtype == torch.float32
