"""The native CPU kernels' build (engine/model/kernels): once per source into the user cache, earlier builds
removed, and PyTorch's kernel where no compiler is found."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from engine.model import int4, kernels
from tests.int4_kernels import dense, int4_kernel, reset_kernel_choice

needs_compiler = pytest.mark.skipif(not any(shutil.which(c) for c in ("cc", "gcc", "clang")),
                                    reason="no C compiler on this machine")


@needs_compiler
def test_built_once_per_source_and_earlier_builds_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(kernels, "kernels_dir", lambda: str(tmp_path))
    (tmp_path / "blocks-0123456789abcdef.so").write_bytes(b"an earlier source's build")
    path = kernels._built()
    assert os.path.dirname(path) == str(tmp_path) and os.path.getsize(path) > 0
    assert os.listdir(tmp_path) == [os.path.basename(path)]  # the earlier build is gone, no temp file left
    lib = kernels.Library(path)
    assert lib.cpu_ok in (True, False)
    # The next process finds it: no compiler runs.
    monkeypatch.setattr(kernels.subprocess, "run", lambda *a, **k: pytest.fail("compiled again"))
    assert kernels._built() == path


def test_without_a_compiler_pytorchs_kernel_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(kernels, "kernels_dir", lambda: str(tmp_path))
    monkeypatch.setattr(kernels.shutil, "which", lambda name: None)
    monkeypatch.delenv(kernels.ENV, raising=False)
    reset_kernel_choice()
    try:
        assert kernels.library() is None
        assert "no C compiler found" in (kernels.unavailable_reason() or "")
        assert int4.kernel() in ("aten", None) and os.listdir(tmp_path) == []
    finally:
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
