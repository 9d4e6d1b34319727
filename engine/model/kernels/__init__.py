"""Native CPU kernels: blocks.c (4- and 8-bit weight products), step.c (a whole decode step of a dense model on
them, engine/model/native_decode.py) and experts.c (its mixture-of-experts layers), one shared library loaded
with ctypes.

Why a kernel of our own: decode reads every weight once a token, and on a CPU with AVX2 but not AVX-512 (most
laptops) PyTorch's 4-bit kernel widens each code to float before multiplying, 72 % of a decode step on the
bundled model; no library reachable from Python ships the integer 4-bit x 8-bit dot products llama.cpp uses
there (torchao's x86 CPU int4 path calls the same ATen kernel; ONNX Runtime's MLAS was no faster here;
docs/BENCHMARKS.md). blocks.c is those dot products and nothing else; step.c runs the few hundred floats of
work between them, which through PyTorch were ~1,500 operator calls a decode step.

Builds. The library comes in three builds of the same source (simd.h), best first: avx512 (AVX-512 F/BW/VL/DQ:
the same 256-bit operations with 32 registers), avx2 (AVX2, FMA, F16C) and generic (any CPU of the architecture,
the intrinsics in portable C, scalar.h). All three give the same results bit for bit, so a conversation's logits
do not depend on the CPU's generation. The package is built with them (setup.py, build.py: Linux x86-64 here,
Windows x86-64 cross-compiled with MinGW-w64), named by a digest of the sources; `library()` takes, in order:
1. a prebuilt library beside this module for this platform and these sources, the best build this CPU runs
   (STRATA_KERNEL_ISA=avx512|avx2|generic forces one; `auto`, the default, takes the best);
2. else the same build compiled now with the machine's C compiler into the user's cache folder, once per source
   (a developer who changed the C; published atomically, reused by later processes);
3. else None: the engine uses PyTorch's kernel, and `unavailable_reason()` says why (also for
   STRATA_INT4_KERNEL=aten). Which build loaded, and from where, goes to the log.

The native kernels are taken on AVX-512 CPUs too: there, with the native decode step, they decoded the bundled
model at 86 against 49 tok/s for PyTorch's AVX-512 kernel through PyTorch's step (one thread of an AVX-512 EPYC,
same hour), while PyTorch's prefilled faster (246 against 186 tok/s). Their int16 activations also keep the
logits closer to float32's than PyTorch's bfloat16 ones (engine/model/int4.py). `native` is `auto`'s choice made
explicit; `aten` keeps PyTorch's.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os

import torch

from engine.config import kernels_dir
from engine.model.kernels import build

log = logging.getLogger("strata.model")

_FOLDER = os.path.dirname(os.path.abspath(__file__))
# Which 4-bit CPU kernel a process uses (engine/model/int4.py, kernel): "auto" (default) and "native" take these
# kernels wherever they can run, "aten" PyTorch's (this module then loads nothing).
ENV = "STRATA_INT4_KERNEL"
CHOICES = ("auto", "native", "aten")
# Which build of them: "auto" (default) the best this CPU runs, else that one (tests compare them; a user can rule
# one out). The builds' results are the same; only their speed differs.
ISA_ENV = "STRATA_KERNEL_ISA"
ISA_CHOICES = ("auto", "avx512", "avx2", "generic")


def choice() -> str:
    """STRATA_INT4_KERNEL, checked (ValueError naming the variable, the value and the choices)."""
    value = os.environ.get(ENV, "auto")
    if value not in CHOICES:
        raise ValueError(f"{ENV}={value!r}: expected one of {', '.join(CHOICES)} (auto and native: the native 4-bit "
                         f"kernel wherever it can run; aten: PyTorch's)")
    return value


def isa_choice() -> str:
    """STRATA_KERNEL_ISA, checked (ValueError naming the variable, the value and the choices)."""
    value = os.environ.get(ISA_ENV, "auto")
    if value not in ISA_CHOICES:
        raise ValueError(f"{ISA_ENV}={value!r}: expected one of {', '.join(ISA_CHOICES)} (auto: the best build of "
                         f"the native kernels this CPU runs)")
    return value


class Field(ctypes.Structure):
    """step.c's Field: one entry of its struct layout table."""

    _fields_ = [("type", ctypes.c_char_p), ("field", ctypes.c_char_p), ("offset", ctypes.c_int64),
                ("size", ctypes.c_int64)]


class Library:
    """The loaded kernels with their function signatures declared; `origin` says where the file came from."""

    def __init__(self, path: str, origin: str = "") -> None:
        lib = ctypes.CDLL(path)  # ctypes.CDLL releases the GIL during calls: other threads run meanwhile
        self.path, self.origin = path, origin
        self.cpu_ok = bool(lib.blocks_cpu_ok())  # baseline code: safe to ask on any CPU
        for name in ("kernels_isa", "kernels_threads"):
            getattr(lib, name).restype = ctypes.c_char_p
        self.isa: str = lib.kernels_isa().decode()
        self.threads: str = lib.kernels_threads().decode()
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self.q4_matmul, self.q8_matmul, self.q4k_matmul = lib.q4_matmul, lib.q8_matmul, lib.q4k_matmul
        self.q6k_matmul, self.mxfp4_matmul = lib.q6k_matmul, lib.mxfp4_matmul
        for fn in (self.q4_matmul, self.q8_matmul, self.q4k_matmul, self.q6k_matmul, self.mxfp4_matmul):  # Product
            fn.argtypes = [ptr, i64, i64, ptr, i64, ptr, ctypes.c_int]
            fn.restype = ctypes.c_int
        self.q6k_to_q8_0 = lib.q6k_to_q8_0  # Q6_K blocks -> Q8_0 rows (engine/model/kquant_weight.py)
        self.q6k_to_q8_0.argtypes = [ptr, i64, ptr, ctypes.c_int]
        self.q6k_to_q8_0.restype = ctypes.c_int
        self.decode_step = lib.decode_step  # arguments: engine/model/native_decode.py
        self.decode_step.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, ctypes.c_int]
        self.decode_step.restype = ctypes.c_int
        self._step_layout = lib.step_layout
        self._step_layout.restype = ctypes.POINTER(Field)

    def layout(self) -> dict[tuple[str, str], tuple[int, int]]:
        """step.c's structs as compiled: (struct, field) -> (offset, size); field "" holds the struct's size."""
        table = self._step_layout()
        out: dict[tuple[str, str], tuple[int, int]] = {}
        for i in range(1000):
            entry = table[i]
            if not entry.type:
                return out
            out[entry.type.decode(), (entry.field or b"").decode()] = (entry.offset, entry.size)
        raise AssertionError("step_layout: no end marker")

    def describe(self) -> str:
        return f"{self.isa} build, {self.threads} threads, {self.origin}: {self.path}"


def product(fn, x: torch.Tensor, shape: tuple[int, int], *weights: torch.Tensor) -> torch.Tensor:
    """x [rows, in] @ w.T -> float32 [rows, out] through `fn` (Library.q4_matmul, q8_matmul, q4k_matmul, q6k_matmul or mxfp4_matmul), w [out, in] held
    by `weights` (passed as pointers in order); MemoryError when the kernel finds no memory for its activations."""
    x = x.float().contiguous()
    rows, (n, k) = x.shape[0], shape
    assert x.shape == (rows, k), (tuple(x.shape), shape)
    out = torch.empty(rows, n)
    if fn(x.data_ptr(), rows, k, *(w.data_ptr() for w in weights), n, out.data_ptr(), torch.get_num_threads()):
        raise MemoryError(f"native product: no memory for the int16 copy of {rows} x {k} activations")
    return out


class RowsWeight:
    """An [out, in] weight held as rows of one of blocks.c's formats (`blocks`, uint8), multiplied by the native
    product named `product_name`; float32 in and out, every row on its own with the same operations whatever the
    other rows or the threads."""

    kernel = "blocks"
    product_name = ""
    rows_code = -1  # blocks.h's ROWS_* for this format (Q4 runs, Int4Weight's, are 0)
    blocks: torch.Tensor
    shape: tuple[int, int]
    dtype: torch.dtype
    device: torch.device

    @property
    def nbytes(self) -> int:
        """The bytes a product reads."""
        return self.blocks.nbytes

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        lib = library()
        assert lib is not None, f"native kernels: {unavailable_reason()}"
        return product(getattr(lib, self.product_name), x, self.shape, self.blocks)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.mm(x)


_reason: str | None = None


@functools.cache
def library() -> Library | None:
    """The kernels loaded (module docstring: a prebuilt library, else one compiled here), or None (see
    unavailable_reason)."""
    global _reason
    if choice() == "aten":
        _reason = f"{ENV}=aten"
        return None
    isa = isa_choice()
    try:
        target = build.target(build.host_name())
    except ValueError as e:
        _reason = str(e)
        return None
    variants = target.variants if isa == "auto" else tuple(v for v in target.variants if v == isa)
    if not variants:
        _reason = f"{ISA_ENV}={isa}: {target.name} has no such build (it has {', '.join(target.variants)})"
        return None
    lib, _reason = _load(target, variants, build.digest())
    if lib is None:
        log.warning("native kernels unavailable (%s); using PyTorch's", _reason)
    else:
        log.info("native kernels: %s", lib.describe())
    return lib


def unavailable_reason() -> str | None:
    """Why library() is None (None when it is not, or has not been asked)."""
    return _reason


def _load(target: build.Target, variants: tuple[str, ...], source: str) -> tuple[Library | None, str | None]:
    """The best of `variants` this CPU runs: the prebuilt file where there is one for these sources, else one
    compiled now (in the user cache; a file from an earlier process is reused). (library, None) or (None, why)."""
    why: list[str] = []
    for variant in variants:
        name = build.library_name(target, variant, source)
        path, origin = os.path.join(_FOLDER, name), "prebuilt"
        if not os.path.isfile(path):
            path, origin = os.path.join(kernels_dir(), name), "built on this machine"
            try:
                _compiled(target, variant, path, source)
            except build.BuildError as e:
                why.append(f"{e} and no prebuilt library for these sources")
                continue
        try:
            lib = Library(path, origin)
        except (OSError, AttributeError) as e:
            why.append(f"{name}: {e}")
            continue
        if lib.cpu_ok:
            return lib, None
        why.append(f"this CPU lacks {build.REQUIRES[variant]} (the {variant} build)")
    return None, "; ".join(dict.fromkeys(why))  # each reason once (no compiler: the same for every build)


def _compiled(target: build.Target, variant: str, path: str, source: str) -> None:
    """Compiles `variant` into `path` unless an earlier process has (BuildError when it cannot be built), and
    removes the cache's builds of earlier sources."""
    if os.path.isfile(path):
        return
    folder = os.path.dirname(path)
    threads = build.compile_variant(target, variant, path)
    if threads != "openmp" and target.openmp:
        log.warning("native kernels (%s) built without OpenMP: their own thread pool runs them", variant)
    log.info("native kernels: %s built with %s", os.path.basename(path), build.find_compiler(target))
    for name in os.listdir(folder):  # a process that still has one loaded keeps its mapping
        if (name.startswith(build.PREFIX) and source not in name) or name.startswith("blocks-"):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(folder, name))
