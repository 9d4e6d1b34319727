"""K/V moved between host memory and a GPU through pinned staging: byte-exact whatever the order of the pieces.

Restored blocks of a slot are gathered into one transfer while they are consecutive; what reads the buffers
(`layer`, `read`, `clear`, a forward pass) sees every row queued before it. CUDA only (`-m gpu`).
"""

from __future__ import annotations

import pytest
import torch

from engine.kv import KVBuffers, KVLayout

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _buffers(stages=(("cuda:0", 0, 3), ("cuda:0", 3, 5))) -> KVBuffers:
    return KVBuffers(KVLayout(5, 2, 16, torch.bfloat16), 3, 4096, list(stages))


def _host(layout: KVLayout, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(layout.host_shape(n), generator=gen).to(layout.dtype)


def test_interleaved_blocks_of_two_slots_restore_byte_exact():
    kv = _buffers()
    a, b = _host(kv.layout, 3000, 1), _host(kv.layout, 700, 2)
    # Slot 0 block by block (more than a staging buffer holds), slot 2 in between, then a gap and a late block.
    for start in range(0, 3000, 64):
        end = min(3000, start + 64)
        kv.write(0, start, a[:, :, start:end].clone(), wait=False)  # a temporary: staging copies it at once
        if start % 256 == 0 and start < 2800:
            kv.write(2, start // 4, b[:, :, start // 4 : start // 4 + 10].clone(), wait=False)
    kv.write(2, 600, b[:, :, 600:700], wait=False)
    k0, _ = kv.layer(0)  # reading a layer sends what is gathered, without synchronize
    torch.cuda.synchronize()
    assert torch.equal(k0[0, :3000].cpu(), a[0, 0])
    assert torch.equal(kv.read(0, 0, 3000), a)
    assert torch.equal(kv.read(2, 600, 700), b[:, :, 600:700])
    for start in range(0, 2800, 256):
        lo = start // 4
        assert torch.equal(kv.read(2, lo, lo + 10), b[:, :, lo : lo + 10])


def test_clear_after_queued_rows_leaves_zeros():
    kv = _buffers()
    kv.write(1, 0, _host(kv.layout, 100, 3), wait=False)
    kv.clear(1)
    kv.synchronize()
    assert kv.read(1, 0, 100).abs().sum() == 0


def test_more_stages_on_one_gpu_than_staging_buffers():
    """Three stages on one device gather six uploads at once, more than the ring's buffers: still exact."""
    kv = _buffers((("cuda:0", 0, 2), ("cuda:0", 2, 4), ("cuda:0", 4, 5)))
    a = _host(kv.layout, 640, 4)
    for start in range(0, 640, 64):
        kv.write(0, start, a[:, :, start : start + 64], wait=False)
    kv.synchronize()
    assert torch.equal(kv.read(0, 0, 640), a)
