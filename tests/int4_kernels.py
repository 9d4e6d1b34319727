"""The two 4-bit CPU kernels (engine/model/int4.py: "blocks", the native one, and "aten", PyTorch's) for tests that
run both, and what each one multiplies by."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from engine.model import int4, kernels

KERNELS = ("blocks", "aten")


def reset_kernel_choice() -> None:
    """Forget the process's 4-bit kernel choice, so that the next Int4Weight makes it again."""
    for cached in (int4.kernel, int4.kernel_slowdown, kernels.library):
        cached.cache_clear()


@pytest.fixture(params=KERNELS)
def kernel(request) -> Iterator[str]:
    """Each 4-bit kernel in turn (import this fixture into a test module to parametrise its tests by it)."""
    with int4_kernel(request.param) as name:
        yield name


@contextmanager
def int4_kernel(name: str) -> Iterator[str]:
    """Int4Weights made inside use kernel `name` (skips the test where the native one cannot run here)."""
    assert name in KERNELS, name
    before = os.environ.get(kernels.ENV)
    os.environ[kernels.ENV] = "native" if name == "blocks" else "aten"
    reset_kernel_choice()
    try:
        if int4.kernel() != name:
            pytest.skip(f"4-bit kernel {name} unavailable here ({kernels.unavailable_reason()})")
        yield name
    finally:
        if before is None:
            os.environ.pop(kernels.ENV, None)
        else:
            os.environ[kernels.ENV] = before
        reset_kernel_choice()


def dense(w: int4.Int4Weight) -> torch.Tensor:
    """The [out, in] matrix the kernel multiplies by: from its codes, scales and minimums ("blocks"), or the
    kernel's product with the identity ("aten": exact in bfloat16)."""
    if w.kernel == "aten":
        return w(torch.eye(w.shape[1])).t()
    codes, scale, minimum = groups(w)
    n, k = w.shape
    return (codes.view(n, -1, int4.GROUP).float() * scale.unsqueeze(-1) + minimum.unsqueeze(-1)).view(n, k)


def groups(w: int4.Int4Weight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A "blocks" weight's codes uint8 [out, in], scale and minimum float32 [out, in // GROUP], read back from its
    rows (int4.q4_runs)."""
    assert w.kernel == "blocks"
    n, k = w.shape
    nb = k // int4.GROUP
    scales, minimums, nibbles = [], [], []
    for b0 in range(0, nb, int4.RUN):
        c = min(int4.RUN, nb - b0)
        run = w.blocks[:, b0 * int4.Q4_BLOCK_BYTES : (b0 + c) * int4.Q4_BLOCK_BYTES]
        scales.append(run[:, : 2 * c].contiguous().view(torch.float16).float())
        minimums.append(run[:, 2 * c : 4 * c].contiguous().view(torch.float16).float())
        nibbles.append(run[:, 4 * c :].reshape(n, c, int4.GROUP // 2))
    codes = torch.cat(nibbles, dim=1)
    codes = torch.cat((codes & 0x0F, codes >> 4), dim=-1).reshape(n, k)
    return codes, torch.cat(scales, dim=1), torch.cat(minimums, dim=1)


def same(a: int4.Int4Weight, b: int4.Int4Weight) -> bool:
    """Whether two 4-bit weights hold the same bytes."""
    sa, sb = a.state(), b.state()
    return a.shape == b.shape and sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def implied(w: int4.Int4Weight, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """The matrix `w`'s kernel multiplies by when built from these groups (a file's): scales and minimums rounded
    to float16 ("blocks": exact for Q4_0 / Q4_1, whose scales are float16 in the file), or to bfloat16 as scale and
    zero point with a bfloat16 output ("aten")."""
    groups = codes.view(*scale.shape, int4.GROUP).float()
    if w.kernel == "aten":
        bf = scale.bfloat16().float(), (minimum + 8 * scale).bfloat16().float()
        return ((groups - 8) * bf[0].unsqueeze(-1) + bf[1].unsqueeze(-1)).view(codes.shape).bfloat16().float()
    half = scale.half().float(), minimum.half().float()
    return (groups * half[0].unsqueeze(-1) + half[1].unsqueeze(-1)).view(codes.shape)
