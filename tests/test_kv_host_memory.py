"""CPU K/V buffers cost resident memory only for the rows written, and a cleared slot gives its pages back."""

from __future__ import annotations

import gc

import psutil
import torch

from engine.kv import KVBuffers, KVLayout

MIB = 1 << 20


def _rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def test_kv_rows_become_resident_as_written_and_clearing_returns_them():
    # RSS is measured only across steps that allocate nothing else big (the full suite's allocators keep what
    # earlier tests freed, so a delta spanning a large temporary would measure the allocator, not the map).
    layout = KVLayout(n_layers=8, n_kv_heads=4, head_dim=64, dtype=torch.float32)  # 16 KiB per token
    before = _rss()
    kv = KVBuffers(layout, 2, 8192, [("cpu", 0, 4), ("cpu", 4, 8)])  # 256 MiB of K/V
    assert kv.nbytes == 256 * MIB
    assert _rss() - before < 32 * MIB  # nothing written yet: zero pages, not resident
    data = torch.randn(layout.host_shape(2048))
    before_write = _rss()
    kv.write(1, 100, data)  # a quarter of slot 1
    written = _rss()
    assert 30 * MIB <= written - before_write < 48 * MIB, (written - before_write) / MIB  # the 32 MiB written
    assert torch.equal(kv.read(1, 2000, 2148), data[:, :, 1900:])  # a small read: no large temporary
    k0, _ = kv.layer(0)
    k0[0, 7].fill_(3.0)  # slot 0 is not touched by clearing slot 1
    kv.clear(1)
    assert written - _rss() >= 24 * MIB  # the cleared rows went back to the kernel
    assert torch.count_nonzero(kv.read(1, 0, 8192)) == 0
    assert torch.count_nonzero(kv.read(0, 0, 8192)) == 4 * 64 and k0[0, 7, 0, 0] == 3.0  # zeros all the same
    kv.write(1, 0, torch.ones(layout.host_shape(10)))  # and a cleared slot is usable again
    assert torch.equal(kv.read(1, 0, 10), torch.ones(layout.host_shape(10)))


def test_clearing_zeroes_partial_pages_at_the_edges():
    # rows of 3 heads x 5 dims x 2 bytes: a slot's span starts and ends inside pages
    layout = KVLayout(n_layers=3, n_kv_heads=3, head_dim=5, dtype=torch.bfloat16)
    kv = KVBuffers(layout, 3, 3001, [("cpu", 0, 3)])
    for slot in range(3):
        kv.write(slot, 0, torch.full(layout.host_shape(3001), slot + 1.0, dtype=torch.bfloat16))
    kv.clear(1)
    assert torch.count_nonzero(kv.read(1, 0, 3001)) == 0
    for slot in (0, 2):
        assert torch.equal(kv.read(slot, 0, 3001), torch.full(layout.host_shape(3001), slot + 1.0,
                                                               dtype=torch.bfloat16))


def test_populating_a_slot_makes_its_pages_resident_and_changes_no_byte():
    """What a restore reader does before the engine thread copies a conversation in: the slot's pages are
    faulted in (so the copy pays no page faults), every byte of every slot stays what it was."""
    from engine.kv.host_memory import populate

    layout = KVLayout(n_layers=8, n_kv_heads=4, head_dim=64, dtype=torch.float32)  # 16 KiB per token
    kv = KVBuffers(layout, 2, 4096, [("cpu", 0, 8)])
    kv.write(0, 0, torch.ones(layout.host_shape(300)))
    kv.write(1, 50, torch.full(layout.host_shape(7), 2.0))  # inside the range populated below
    if not populate(kv.layer(0)[0][0, 1, 4000:4096]):
        return  # a kernel without MADV_POPULATE_WRITE: populate does nothing, and says so
    before = _rss()
    kv.populate(1, 0, 2048)
    assert _rss() - before >= 28 * MIB  # the 32 MiB of slot 1's first 2048 tokens are resident now
    assert torch.equal(kv.read(1, 50, 57), torch.full(layout.host_shape(7), 2.0))
    assert torch.count_nonzero(kv.read(1, 0, 50)) == 0 and torch.count_nonzero(kv.read(1, 57, 4096)) == 0
    assert torch.equal(kv.read(0, 0, 300), torch.ones(layout.host_shape(300)))
    assert torch.count_nonzero(kv.read(0, 300, 4096)) == 0
