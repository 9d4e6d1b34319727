"""The native CPU kernels' builds and their loading (engine/model/kernels): every build of the source (avx512, avx2,
generic; OpenMP or the kernels' own thread pool) computes the same bits; a prebuilt library for the current
sources is taken before anything is compiled, a stale or missing one is compiled once into the user cache, and
PyTorch's kernel runs where neither can be had; the structs Python fills in match step.c's as compiled."""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from engine.model import int4, kernels, native_decode
from engine.model.kernels import build
from engine.model.native_decode import NativeDecode
from tests.int4_kernels import dense, int4_kernel, reset_kernel_choice
from tests.model_fixtures import write_decode_models
from tests.moe_fixtures import write_tiny_moe_model
from tests.test_native_decode import PROMPTS, _native_model, _prefilled, _step

HOST = build.target(build.host_name())
needs_compiler = pytest.mark.skipif(build.find_compiler(HOST) is None, reason="no C compiler on this machine")


@contextmanager
def kernel_isa(variant: str) -> Iterator[kernels.Library | None]:
    """STRATA_KERNEL_ISA=variant while inside, the process's choices made again on entry and on exit."""
    before = os.environ.get(kernels.ISA_ENV)
    os.environ[kernels.ISA_ENV] = variant
    reset_kernel_choice()
    try:
        yield kernels.library()
    finally:
        if before is None:
            os.environ.pop(kernels.ISA_ENV, None)
        else:
            os.environ[kernels.ISA_ENV] = before
        reset_kernel_choice()


def builds_here() -> dict[str, kernels.Library]:
    """Each build this CPU runs, loaded (prebuilt, or compiled into the user cache as the engine would)."""
    found = {}
    for variant in HOST.variants:
        with kernel_isa(variant) as lib:
            if lib is not None:
                found[variant] = lib
    return found


def random_rows(kind: str, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Random weight rows [n, row bytes] of a product's format, their float16 scales finite."""
    if kind == "q4":
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        return int4.q4_runs(codes, torch.rand(n, k // 32, generator=gen) * 0.01,
                            torch.randn(n, k // 32, generator=gen) * 0.01)
    size, nb = {"q8": (34, k // 32), "q4k": (144, k // 256), "q6k": (210, k // 256), "mxfp4": (17, k // 32)}[kind]
    rows = torch.randint(0, 256, (n, nb, size), generator=gen, dtype=torch.uint8)
    for at in {"q8": (0,), "q4k": (0, 2), "q6k": (208,), "mxfp4": ()}[kind]:
        rows[..., at : at + 2] = (torch.randn(n, nb, 1, generator=gen) * 0.01).half().view(torch.uint8)
    if kind == "mxfp4":  # e8m0 exponents of weights' magnitudes (2^-18 .. 2^2)
        rows[..., 0] = torch.randint(110, 131, (n, nb), generator=gen, dtype=torch.uint8)
    return rows.view(n, -1).contiguous()


# rows, outputs, inputs: decode and prefill tiles (1-3 rows in one tile), tails of 4 rows (1-3) and of output
# pairs, runs of 8 blocks cut short
SHAPES = ((1, 64, 512), (2, 17, 512), (3, 33, 256), (5, 48, 768), (7, 34, 512), (9, 80, 1024), (4, 31, 256),
          (1, 16, 544))


def products(lib: kernels.Library, threads: int) -> list[torch.Tensor]:
    """Every product of `lib` on the same random inputs (wide-ranged activations), and a Q6_K conversion."""
    gen = torch.Generator().manual_seed(5)
    out = []
    for kind in ("q4", "q8", "q4k", "q6k", "mxfp4"):
        for rows, n, k in SHAPES:
            if kind in ("q4k", "q6k") and k % 256:
                continue
            w = random_rows(kind, n, k, gen)
            x = torch.randn(rows, k, generator=gen) * torch.logspace(-3, 1, k)
            out.append(kernels.product(getattr(lib, f"{kind}_matmul"), x, (n, k), w))
    q6k = random_rows("q6k", 64, 1024, gen)
    converted = torch.empty(64 * 1024 // 32 * 34, dtype=torch.uint8)
    assert lib.q6k_to_q8_0(q6k.data_ptr(), 64 * 4, converted.data_ptr(), threads) == 0
    return [*out, converted]


def same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def here() -> dict[str, kernels.Library]:
    found = builds_here()
    if not found:
        pytest.skip(f"no build of the native kernels loads here ({kernels.unavailable_reason()})")
    return found


@pytest.fixture(scope="module")
def pool_build(here, tmp_path_factory) -> kernels.Library:
    """The best build here compiled without OpenMP: its parts run on parallel.c's own threads, as on Windows."""
    if build.find_compiler(HOST) is None:
        pytest.skip("no C compiler on this machine")
    variant = next(iter(here))
    path = str(tmp_path_factory.mktemp("pool") / build.library_name(HOST, variant, "pool"))
    assert build.compile_variant(dataclasses.replace(HOST, openmp=False), variant, path) == "pool"
    lib = kernels.Library(path, "test")
    assert lib.threads == "pool" and lib.isa == variant
    return lib


def test_every_build_computes_the_same_bits(here):
    names = list(here)
    if len(names) < 2:
        pytest.skip(f"only the {names[0]} build runs here")
    assert "generic" in names and here["generic"].isa == "generic"
    reference = products(here[names[0]], threads=1)
    for name in names:
        for threads in (1, 3):
            assert same_bits(products(here[name], threads), reference), f"{name} on {threads} threads"


def test_a_row_is_the_same_whichever_tile_computes_it(here):
    """1-3 rows share one tile, as do the 1-3 left after a batch's tiles of 4: each row's bits stay its own."""
    lib = here[next(iter(here))]
    gen = torch.Generator().manual_seed(7)
    for kind in ("q4", "q8", "q4k", "q6k", "mxfp4"):
        n, k = 34, 512
        w = random_rows(kind, n, k, gen)
        x = torch.randn(7, k, generator=gen) * torch.logspace(-3, 1, k)
        product = getattr(lib, f"{kind}_matmul")
        alone = torch.cat([kernels.product(product, x[r : r + 1], (n, k), w) for r in range(7)])
        for rows in (2, 3, 6, 7):
            assert torch.equal(kernels.product(product, x[:rows], (n, k), w), alone[:rows]), f"{kind}, {rows} rows"


def test_the_thread_pool_computes_the_same_bits_also_under_concurrent_calls(here, pool_build):
    reference = products(next(iter(here.values())), threads=1)
    for threads in (1, 2, 5):
        assert same_bits(products(pool_build, threads), reference), f"pool on {threads} threads"
    # two callers at once: one has the pool, the other runs its parts itself
    failures: list[str] = []

    def caller(name: str) -> None:
        for _ in range(6):
            if not same_bits(products(pool_build, 2), reference):
                failures.append(name)

    callers = [threading.Thread(target=caller, args=(f"caller {i}",)) for i in range(2)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(120)
    assert not failures and not any(t.is_alive() for t in callers)


@pytest.fixture(scope="module")
def decode_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    models = write_decode_models(root)
    return {"gemma3": models["gemma3"], "qwen2_moe": write_tiny_moe_model(root / "moe", "qwen2_moe")}


def _decode(path: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Three native decode steps after forward_chunks' prefills (whose products are this build's too): the logits
    and each slot's K/V."""
    lm = _native_model(path)
    with torch.inference_mode():
        kv = _prefilled(lm, torch.bfloat16)
        runner = NativeDecode(lm.model)
        logits = torch.cat([runner.run(_step(k), kv) for k in range(3)])
    return logits, [kv.read(slot, 0, n + 3) for slot, n in PROMPTS.items()]


@pytest.mark.parametrize("model", ["gemma3", "qwen2_moe"])
def test_every_build_decodes_the_same_bits(here, pool_build, decode_models, model, monkeypatch):
    results = {}
    for name in here:
        with kernel_isa(name):
            results[name] = _decode(decode_models[model])
    monkeypatch.setattr(kernels, "library", functools.cache(lambda: pool_build))  # kept through the resets
    results["pool"] = _decode(decode_models[model])
    first, (logits, kv) = next(iter(results)), next(iter(results.values()))
    for name, (other_logits, other_kv) in results.items():
        assert torch.equal(other_logits, logits), f"{name}'s logits differ from {first}'s"
        assert all(torch.equal(a, b) for a, b in zip(other_kv, kv, strict=True)), f"{name}'s K/V differ from {first}'s"


def test_the_structs_python_fills_in_are_step_cs(here, monkeypatch):
    for name, lib in here.items():
        layout = lib.layout()
        assert native_decode.layout_mismatch(lib) is None, name
        assert layout["StepModel", ""][1] == ctypes.sizeof(native_decode.StepModel)
        assert {t for t, _ in layout} == {"StepModel", "StepLayer", "StepExperts"}

    # a field added on one side only is found, by name
    class Shifted(ctypes.Structure):
        _fields_ = [("extra", ctypes.c_int64), *native_decode.StepExperts._fields_]

    monkeypatch.setitem(native_decode._MIRRORS, "StepExperts", Shifted)
    why = native_decode.layout_mismatch(next(iter(here.values())))
    assert why is not None and "StepExperts.extra" in why and "StepExperts.n_experts" in why


def test_a_prebuilt_library_is_taken_without_compiling(here, tmp_path, monkeypatch):
    package, cache = tmp_path / "package", tmp_path / "cache"
    package.mkdir()
    best = next(iter(here))
    name = build.library_name(HOST, best, build.digest())
    shutil.copy(here[best].path, package / name)
    monkeypatch.setattr(kernels, "_FOLDER", str(package))
    monkeypatch.setattr(kernels, "kernels_dir", lambda: str(cache))
    monkeypatch.setattr(build.subprocess, "run", lambda *a, **k: pytest.fail("compiled"))
    monkeypatch.delenv(kernels.ISA_ENV, raising=False)
    reset_kernel_choice()
    try:
        lib = kernels.library()
        assert lib is not None and lib.origin == "prebuilt" and lib.path == str(package / name) and lib.isa == best
        assert int4.describe_kernel().startswith(f"native ({best} build")
        assert not cache.exists()
    finally:
        reset_kernel_choice()


@needs_compiler
def test_stale_prebuilt_libraries_are_compiled_again_once_and_earlier_builds_removed(tmp_path, monkeypatch):
    package, cache = tmp_path / "package", tmp_path / "cache"
    package.mkdir()
    cache.mkdir()
    (package / build.library_name(HOST, "generic", "0123456789abcdef")).write_bytes(b"a build of other sources")
    (cache / build.library_name(HOST, "generic", "fedcba9876543210")).write_bytes(b"an earlier source's build")
    (cache / "blocks-0123456789abcdef.so").write_bytes(b"the previous naming's build")
    monkeypatch.setattr(kernels, "_FOLDER", str(package))
    monkeypatch.setattr(kernels, "kernels_dir", lambda: str(cache))
    with kernel_isa("generic") as lib:
        assert lib is not None and lib.origin == "built on this machine" and lib.isa == "generic"
        assert os.listdir(cache) == [os.path.basename(lib.path)]  # the earlier builds are gone, no scratch left
    # The next process finds it: no compiler runs.
    monkeypatch.setattr(build.subprocess, "run", lambda *a, **k: pytest.fail("compiled again"))
    with kernel_isa("generic") as again:
        assert again is not None and again.path == lib.path


def test_without_a_compiler_or_a_prebuilt_library_pytorchs_kernel_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(kernels, "_FOLDER", str(tmp_path / "package"))
    monkeypatch.setattr(kernels, "kernels_dir", lambda: str(tmp_path / "cache"))
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    monkeypatch.delenv(kernels.ENV, raising=False)
    monkeypatch.delenv(kernels.ISA_ENV, raising=False)
    reset_kernel_choice()
    try:
        assert kernels.library() is None
        why = kernels.unavailable_reason() or ""
        assert "no C compiler found" in why and "no prebuilt library" in why and why.count("no C compiler") == 1
        assert int4.kernel() in ("aten", None) and not (tmp_path / "cache").exists()
    finally:
        reset_kernel_choice()


def test_the_best_build_this_cpu_runs_is_taken(here, monkeypatch):
    if len(here) < 2:
        pytest.skip("one build runs here")
    best, second = list(here)[:2]

    class Without(kernels.Library):  # a CPU without the best build's instructions
        def __init__(self, path: str, origin: str = "") -> None:
            super().__init__(path, origin)
            self.cpu_ok = self.cpu_ok and self.isa != best

    monkeypatch.setattr(kernels, "Library", Without)
    with kernel_isa("auto") as lib:
        assert lib is not None and lib.isa == second
    with kernel_isa(best) as lib:
        assert lib is None and f"this CPU lacks {build.REQUIRES[best]}" in (kernels.unavailable_reason() or "")


def test_a_bad_build_choice_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(kernels.ISA_ENV, "sse9")
    reset_kernel_choice()
    try:
        with pytest.raises(ValueError, match="STRATA_KERNEL_ISA='sse9': expected one of auto, avx512, avx2, generic"):
            kernels.library()
    finally:
        monkeypatch.delenv(kernels.ISA_ENV)
        reset_kernel_choice()


def test_the_native_products_match_float32_on_awkward_shapes():
    with int4_kernel("blocks"):
        torch.manual_seed(3)
        # tile tails (rows not a multiple of 4); runs of 8 blocks with and without a shorter last one
        for rows, n, k in ((1, 16, 32), (5, 48, 96), (9, 80, 320), (3, 16, 544), (4, 32, 256)):
            w = torch.randn(n, k)
            q = int4.Int4Weight(w)
            x = torch.randn(rows, k) * torch.logspace(-3, 1, k)  # a wide range of magnitudes in a block
            ref = x.double() @ dense(q).double().t()
            got = q(x)
            assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-4
            for r in range(rows):  # each row as if alone
                assert torch.equal(q(x[r : r + 1])[0], got[r])
