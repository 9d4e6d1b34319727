"""How the native kernels are compiled: one shared library per instruction set ("variant", simd.h) and target
platform, named by a digest of the sources. The one place that knows the compilers and flags: setup.py runs it
when the package is built (loading this file by path: torch is not importable in an isolated build, so only the
standard library is used here), scripts/build-kernels.sh cross-compiles the Windows and ARM64 builds with it, and
__init__.py runs it for the first-use compile of a developer who changed the C.

    python engine/model/kernels/build.py [--target linux-x86_64|windows-x86_64|linux-aarch64] [--out DIR]
                                         [--cc COMPILER] [--variant NAME ...]

Variants, best first: avx512 and avx2 (x86-64), generic (every architecture; bit for bit the same results).
Threads: OpenMP on Linux (PyTorch's libgomp.so.1 is loaded first, so the kernels share its runtime), the
kernels' own pool (parallel.c) on Windows, where PyTorch brings an LLVM/Intel OpenMP runtime that MinGW's libgomp
would run beside, and wherever -fopenmp does not link.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

FOLDER = os.path.dirname(os.path.abspath(__file__))
SOURCES = ("blocks.c", "step.c", "experts.c", "parallel.c")  # compiled together into one library
HEADERS = ("blocks.h", "experts.h", "parallel.h", "scalar.h", "simd.h", "vector.h")
PREFIX = "_strata_kernels"
# -ffp-contract=off: the compiler must not fuse a multiply and an add in one tile shape and not in another (or in
# one build and not another), or a row's result would depend on how many rows share the call, or on the CPU.
# -fvisibility=hidden: the library exports its entry points only (blocks.h's EXPORT); -s: no symbol table (it
# would record the build folder and the compiler's scratch file names: the same sources give the same bytes).
FLAGS = ("-O3", "-ffp-contract=off", "-std=c11", "-fvisibility=hidden", "-shared", "-s")
# -Wno-psabi: the generic build passes its 256-bit vector values between its own static functions, where GCC notes
# that the ABI for them differs without AVX; nothing exported takes one.
ISA_FLAGS = {"avx512": ("-DSTRATA_ISA_AVX512",), "avx2": ("-DSTRATA_ISA_AVX2",),
             "generic": ("-DSTRATA_ISA_GENERIC", "-Wno-psabi")}
# What each variant needs of the CPU (blocks_cpu_ok checks it), for messages.
REQUIRES = {"avx512": "AVX-512 F/BW/VL/DQ with AVX2, FMA and F16C", "avx2": "AVX2, FMA and F16C", "generic": "nothing"}


class BuildError(RuntimeError):
    """A library could not be compiled (the message names the compiler and its last error line)."""


@dataclass(frozen=True)
class Target:
    """A platform the kernels are built for: `name` as in the libraries' file names (linux-x86_64, ...)."""

    name: str
    variants: tuple[str, ...]  # best first
    suffix: str  # ".so", ".dll", ".dylib"
    flags: tuple[str, ...]  # besides FLAGS
    libs: tuple[str, ...]
    openmp: bool  # whether the parts run on OpenMP (else parallel.c's pool)
    compilers: tuple[str, ...]  # tried in order after $CC (a native build) or the cross compiler

    @property
    def system(self) -> str:
        return self.name.split("-")[0]


def target(name: str) -> Target:
    """The Target called `name` ("<system>-<machine>"; ValueError for a system the project does not know). For
    another machine than this one, only its cross compiler will do."""
    system, _, machine = name.partition("-")
    variants = ("avx512", "avx2", "generic") if machine == "x86_64" else ("generic",)
    native = name == host_name()
    if system == "linux":
        compilers = ("cc", "gcc", "clang") if native else (f"{machine}-linux-gnu-gcc",)
        return Target(name, variants, ".so", ("-fPIC",), ("-lm",), True, compilers)
    if system == "windows":
        # MinGW-w64: libgcc linked in, the C runtime Windows' own msvcrt.dll; no timestamp and a fixed preferred
        # base address (ASLR moves it anyway) so that the same sources give the same bytes.
        link = ("-static-libgcc", "-Wl,--no-insert-timestamp,--disable-auto-image-base")
        cross = f"{machine}-w64-mingw32-gcc"
        return Target(name, variants, ".dll", link, (), False, ("gcc", "clang", cross) if native else (cross,))
    if system == "darwin":  # Apple's clang has no OpenMP: the pool
        return Target(name, variants, ".dylib", ("-fPIC",), (), False, ("cc", "clang") if native else ())
    raise ValueError(f"no native kernel build for {name}")


def host_name() -> str:
    """This machine's target name, e.g. linux-x86_64 or windows-x86_64."""
    system = {"win32": "windows", "cygwin": "windows"}.get(sys.platform, sys.platform.rstrip("0123456789"))
    machine = platform.machine().lower()
    machine = {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}.get(machine, machine)
    return f"{system}-{machine}"


def digest(folder: str = FOLDER) -> str:
    """A digest of the sources, the headers and this file (the flags): what a library's name records. Line endings
    are normalised, so a Windows checkout (CRLF) names the same libraries as a Linux one."""
    h = hashlib.sha256()
    for name in (*SOURCES, *HEADERS, "build.py"):
        with open(os.path.join(folder, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read().replace(b"\r\n", b"\n") + b"\0")
    return h.hexdigest()[:16]


def library_name(t: Target, variant: str, source: str) -> str:
    return f"{PREFIX}-{t.name}-{variant}-{source}{t.suffix}"


def find_compiler(t: Target) -> str | None:
    """$CC (for a build for this machine), else the first of the target's compilers on PATH."""
    cc = os.environ.get("CC") if t.name == host_name() else None
    return next((c for c in (cc, *t.compilers) if c and shutil.which(c)), None)


def command(t: Target, variant: str, compiler: str, out: str, openmp: bool, folder: str = FOLDER) -> list[str]:
    threads = ["-fopenmp"] if openmp else ["-pthread"] if t.system != "windows" else []
    return [compiler, *FLAGS, *t.flags, *ISA_FLAGS[variant], *threads, "-o", out,
            *(os.path.join(folder, s) for s in SOURCES), *t.libs]


def compile_variant(t: Target, variant: str, out: str, compiler: str | None = None,
                    source_folder: str = FOLDER) -> str:
    """Compiles `variant` for `t` into the file `out` (written whole or not at all); returns how its parts run:
    "openmp", or "pool" where -fopenmp did not link (the reason goes into a warning of the caller's). BuildError
    when it cannot be built."""
    compiler = compiler or find_compiler(t)
    if compiler is None:
        raise BuildError(f"no C compiler found for {t.name} (looked for {', '.join(t.compilers)} and $CC)")
    folder = os.path.dirname(os.path.abspath(out))
    os.makedirs(folder, exist_ok=True)
    # Linked under its final name (a DLL records it), in a scratch folder beside it, then moved into place.
    scratch_dir = tempfile.mkdtemp(prefix=".building-", dir=folder)
    scratch = os.path.join(scratch_dir, os.path.basename(out))
    errors: list[str] = []
    try:
        for openmp in (True, False) if t.openmp else (False,):
            done = subprocess.run(command(t, variant, compiler, scratch, openmp, source_folder), capture_output=True,
                                  text=True)
            if done.returncode == 0:
                try:
                    os.replace(scratch, out)  # atomic: a concurrent build writes the same bytes
                except PermissionError:  # Windows: another process has it loaded already
                    if not os.path.isfile(out):
                        raise
                return "openmp" if openmp else "pool"
            errors.append(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}")
        raise BuildError(f"{compiler} could not build the {variant} kernels for {t.name}: {errors[-1]}")
    finally:
        shutil.rmtree(scratch_dir, ignore_errors=True)


def build(t: Target, out_dir: str, variants: tuple[str, ...] | None = None, compiler: str | None = None,
          reuse: str | None = None, log=print) -> list[str]:
    """Every variant of `t` (or those named) for the current sources into out_dir, skipping those already there and
    copying those the folder `reuse` holds; earlier sources' libraries of the same target are removed. Returns the
    libraries' paths, best variant first (BuildError when one cannot be built)."""
    source = digest()
    wanted = variants or t.variants
    unknown = [v for v in wanted if v not in t.variants]
    if unknown:
        raise BuildError(f"no {', '.join(unknown)} build for {t.name} (it has {', '.join(t.variants)})")
    os.makedirs(out_dir, exist_ok=True)
    paths = {v: os.path.join(out_dir, library_name(t, v, source)) for v in wanted}
    done = {v: "up to date" for v in wanted if os.path.isfile(paths[v])}
    for v in wanted:
        there = os.path.join(reuse, library_name(t, v, source)) if reuse else ""
        if v not in done and os.path.isfile(there) and os.path.abspath(there) != os.path.abspath(paths[v]):
            shutil.copy2(there, paths[v])
            done[v] = "copied"
    missing = [v for v in wanted if v not in done]
    workers = max(1, min(len(missing), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:  # the compilers run as processes
        futures = {v: pool.submit(compile_variant, t, v, paths[v], compiler) for v in missing}
        for v, future in futures.items():
            threads = future.result()
            done[v] = "built" if threads == "openmp" or not t.openmp else "built without OpenMP: its own threads"
    for name in os.listdir(out_dir):
        if name.startswith(f"{PREFIX}-{t.name}-") and name.endswith(t.suffix) and source not in name:
            os.unlink(os.path.join(out_dir, name))
    for v in wanted:
        log(f"build: {os.path.basename(paths[v])}: {os.path.getsize(paths[v]) / 1024:.0f} KiB ({done[v]})")
    return [paths[v] for v in wanted]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the native kernels' libraries.")
    parser.add_argument("--target", default=host_name(), help="e.g. linux-x86_64, windows-x86_64, linux-aarch64")
    parser.add_argument("--out", default=FOLDER, help="folder for the libraries (default: beside the sources)")
    parser.add_argument("--cc", help="the compiler (default: $CC or the target's usual one on PATH)")
    parser.add_argument("--variant", action="append", help="only this variant (repeatable)")
    args = parser.parse_args(argv)
    try:
        build(target(args.target), args.out, tuple(args.variant) if args.variant else None, args.cc)
    except (BuildError, ValueError) as e:
        print(f"build: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
