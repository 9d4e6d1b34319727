"""Native CPU kernels: blocks.c (4- and 8-bit weight products) and step.c (a whole decode step of a dense model
on them, engine/model/native_decode.py), compiled on first use with the machine's C compiler into one shared
library and loaded with ctypes.

Why a kernel of our own: decode reads every weight once a token, and on a CPU with AVX2 but not AVX-512 (most
laptops) PyTorch's 4-bit kernel widens each code to float before multiplying, 72 % of a decode step on the
bundled model; no library reachable from Python ships the integer 4-bit x 8-bit dot products llama.cpp uses
there (torchao's x86 CPU int4 path calls the same ATen kernel; ONNX Runtime's MLAS was no faster here;
docs/BENCHMARKS.md). blocks.c is those dot products and nothing else; step.c runs the few hundred floats of
work between them, which through PyTorch were ~1,500 operator calls a decode step.

The shared library is built once per source text and machine architecture into the user's cache folder (about a
second with gcc), published atomically, and reused by every later process. Where no compiler is found, the
build fails, the CPU lacks AVX2 / FMA / F16C, or STRATA_INT4_KERNEL=aten asks for it, `library()` returns None
and the engine uses PyTorch's kernel; `unavailable_reason()` says why.

The kernels are AVX2 code, and `auto` takes them on AVX-512 CPUs too: there, with the native decode step, they
decoded the bundled model at 86 against 49 tok/s for PyTorch's AVX-512 kernel through PyTorch's step (one thread
of an AVX-512 EPYC, same hour), while PyTorch's prefilled faster (246 against 186 tok/s; a 512-bit version of
blocks.c measured no faster there). Their int16 activations also keep the logits closer to float32's than
PyTorch's bfloat16 ones (engine/model/int4.py). `native` is `auto`'s choice made explicit; `aten` keeps PyTorch's.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile

import torch
import xxhash

from engine import atomic
from engine.config import kernels_dir

log = logging.getLogger("strata.model")

_FOLDER = os.path.dirname(__file__)
_SOURCES = ("blocks.c", "step.c", "experts.c")  # compiled together into one library
_HEADERS = ("blocks.h", "experts.h", "vector.h")  # what the sources share (hashed with them)
# -ffp-contract=off: the compiler must not fuse a multiply and an add in one tile shape and not in another, or a
# row's result would depend on how many rows share the call.
_FLAGS = ["-O3", "-fPIC", "-shared", "-ffp-contract=off", "-std=c11"]
_LIBS = ["-lm"]
_OPENMP = ["-fopenmp"]  # torch has libgomp loaded already: the kernel's threads come from the same runtime
_COMPILERS = ("cc", "gcc", "clang")
# Which 4-bit CPU kernel a process uses (engine/model/int4.py, kernel): "auto" (default) and "native" take these
# kernels wherever they can run, "aten" PyTorch's (this module then builds nothing).
ENV = "STRATA_INT4_KERNEL"
CHOICES = ("auto", "native", "aten")


def choice() -> str:
    """STRATA_INT4_KERNEL, checked (ValueError naming the variable, the value and the choices)."""
    value = os.environ.get(ENV, "auto")
    if value not in CHOICES:
        raise ValueError(f"{ENV}={value!r}: expected one of {', '.join(CHOICES)} (auto and native: the native 4-bit "
                         f"kernel wherever it can run; aten: PyTorch's)")
    return value


class Library:
    """The loaded kernels with their function signatures declared."""

    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path)  # ctypes.CDLL releases the GIL during calls: other threads run meanwhile
        self.path = path
        self.cpu_ok = bool(lib.blocks_cpu_ok())
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self.q4_matmul, self.q8_matmul, self.q4k_matmul = lib.q4_matmul, lib.q8_matmul, lib.q4k_matmul
        self.q6k_matmul = lib.q6k_matmul
        for fn in (self.q4_matmul, self.q8_matmul, self.q4k_matmul, self.q6k_matmul):  # blocks.h's Product
            fn.argtypes = [ptr, i64, i64, ptr, i64, ptr, ctypes.c_int]
            fn.restype = ctypes.c_int
        self.q6k_to_q8_0 = lib.q6k_to_q8_0  # Q6_K blocks -> Q8_0 rows (engine/model/kquant_weight.py)
        self.q6k_to_q8_0.argtypes = [ptr, i64, ptr, ctypes.c_int]
        self.q6k_to_q8_0.restype = ctypes.c_int
        self.decode_step = lib.decode_step  # arguments: engine/model/native_decode.py
        self.decode_step.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, ptr, ctypes.c_int]
        self.decode_step.restype = ctypes.c_int


def product(fn, x: torch.Tensor, shape: tuple[int, int], *weights: torch.Tensor) -> torch.Tensor:
    """x [rows, in] @ w.T -> float32 [rows, out] through `fn` (Library.q4_matmul, q8_matmul, q4k_matmul or q6k_matmul), w [out, in] held
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
    """The kernels built and loaded, or None (see unavailable_reason)."""
    global _reason
    if choice() == "aten":
        _reason = f"{ENV}=aten"
        return None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        _reason = f"written for x86-64 (AVX2), this is {platform.machine()}"
        return None
    try:
        lib = Library(_built())
    except (OSError, RuntimeError) as e:
        _reason = str(e)
        log.warning("native 4-bit kernel unavailable (%s); using PyTorch's", e)
        return None
    if not lib.cpu_ok:
        _reason = "this CPU lacks AVX2, FMA or F16C"
        return None
    return lib


def unavailable_reason() -> str | None:
    """Why library() is None (None when it is not, or has not been asked)."""
    return _reason


def _built() -> str:
    """The path of the shared library for this source, built now if no earlier process has (RuntimeError when
    it cannot be)."""
    source = b""
    for name in (*_SOURCES, *_HEADERS):
        with open(os.path.join(_FOLDER, name), "rb") as f:
            source += name.encode() + b"\0" + f.read()
    digest = xxhash.xxh3_64(source + platform.machine().encode() + sys.platform.encode()).hexdigest()
    folder = kernels_dir()
    path = os.path.join(folder, f"blocks-{digest}{'.dll' if os.name == 'nt' else '.so'}")
    if os.path.isfile(path):
        return path
    compiler = next((c for c in (os.environ.get("CC"), *_COMPILERS) if c and shutil.which(c)), None)
    if compiler is None:
        raise RuntimeError(f"no C compiler found (looked for {', '.join(_COMPILERS)} and $CC)")
    os.makedirs(folder, exist_ok=True)
    errors: list[str] = []
    with tempfile.TemporaryDirectory() as scratch:
        for extra in (_OPENMP, []):  # without OpenMP the kernel runs on one thread
            out = os.path.join(scratch, "blocks.so")
            sources = [os.path.join(_FOLDER, name) for name in _SOURCES]
            done = subprocess.run([compiler, *_FLAGS, *extra, "-o", out, *sources, *_LIBS], capture_output=True,
                                  text=True)
            if done.returncode == 0:
                if not extra:
                    log.warning("native 4-bit kernel built without OpenMP (%s): it runs on one thread", errors[-1])
                with open(out, "rb") as f:
                    atomic.atomic_write(path, [f.read()])  # a concurrent build writes the same bytes
                log.info("native 4-bit kernel built with %s: %s", compiler, path)
                _prune(folder, keep=os.path.basename(path))
                return path
            errors.append(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}")
    raise RuntimeError(f"{compiler} could not build {' and '.join(_SOURCES)}: {errors[-1]}")


def _prune(folder: str, keep: str) -> None:
    """Remove the builds of earlier sources (a process that still has one loaded keeps its mapping)."""
    for name in os.listdir(folder):
        if name.startswith("blocks-") and name != keep:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(folder, name))
