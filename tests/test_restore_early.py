"""A restore delivered on the reader thread (`RestoreRead.deliver_early`, the path of a slot on a GPU) hands its
outcome to the engine thread's `deliver` without writing twice, and a RAM entry being read off the engine thread
is pinned. On CUDA (`-m gpu`): `SlotUpload` writes a slot from another thread on a copy stream, byte-exact,
ordered after what the main stream still had queued for the slot and before what comes after `join`."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.cache.errors import CacheRestoreError
from engine.cache.parts import kv_writer
from tests.test_cache_support import FakeSlots, make_cache, park_tokens

TOKENS = list(range(100, 180))  # five blocks


def _parked():
    cache, slots = make_cache(), FakeSlots()
    park_tokens(cache, slots, TOKENS)
    want = slots.snapshot(0, len(TOKENS))
    slots.kv.clear(0)
    hit = cache.lookup(TOKENS + [1])
    assert hit is not None and hit.n_tokens == len(TOKENS)
    return cache, slots, hit, want


def test_an_early_delivery_writes_once_and_deliver_hands_back_its_result():
    cache, slots, hit, want = _parked()
    read = cache.begin_restore(hit)
    conv = read.conv
    assert conv.pins == 1 and all(b.pins == 1 for b in read.blocks)  # a RAM entry too: read off this thread
    read.read()
    assert conv.pins == 0 and all(b.pins == 0 for b in read.blocks)
    writes: list[int] = []
    landed: list[bool] = []

    def write(start: int, data: torch.Tensor) -> None:
        writes.append(start)
        slots.kv.write(1, start, data)

    worker = threading.Thread(target=read.deliver_early, args=(kv_writer(write), lambda: landed.append(True)))
    worker.start()
    worker.join()
    assert landed == [True] and writes
    # counted once the engine thread takes it: one dropped now (its conversation purged meanwhile) is no restore
    assert cache.stats().restores == 0 and conv.hits == 0
    n_writes = len(writes)
    result = read.deliver(kv_writer(write))  # the engine thread: nothing written again
    assert len(writes) == n_writes and result.n_tokens == len(TOKENS) and result.tier == "ram"
    assert torch.equal(slots.snapshot(1, len(TOKENS)), want)
    assert cache.stats().restores == 1


def test_a_failed_early_delivery_still_waits_for_what_was_sent_and_fails_on_the_engine_thread():
    cache, _, hit, _ = _parked()
    read = cache.begin_restore(hit)
    read.read()
    landed: list[bool] = []

    def broken(start: int, parts) -> None:
        raise RuntimeError("device lost")

    read.deliver_early(broken, lambda: landed.append(True))
    assert landed == [True]
    with pytest.raises(RuntimeError, match="device lost"):
        read.deliver(broken)
    assert cache.stats().restores == 0


def test_an_early_delivery_of_a_failed_read_raises_its_restore_error():
    cache, _, hit, _ = _parked()
    read = cache.begin_restore(hit)
    read.read()
    read.error = CacheRestoreError("stored state is damaged")  # what read() keeps for a bad piece
    read.deliver_early(lambda start, parts: None, lambda: None)
    with pytest.raises(CacheRestoreError, match="damaged"):
        read.deliver(lambda start, parts: None)


# ------------------------------------------------------------------ CUDA: the copy stream

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@cuda_only
def test_an_upload_from_another_thread_lands_after_the_main_streams_queued_work_and_is_byte_exact():
    from engine.kv import KVBuffers, KVLayout
    from engine.kv.pinned_staging import STAGING_BUFFER_BYTES, STAGING_BUFFERS
    from engine.kv.stream_upload import StreamUploads

    layout = KVLayout(6, 8, 128, torch.bfloat16)  # 24 KiB per token
    kv = KVBuffers(layout, 2, 8192, [("cuda:0", 0, 4), ("cpu", 4, 5), ("cuda:0", 5, 6)])
    n = 8000  # more than the reader's staging ring holds: its buffers are reused after their events
    assert n * layout.bytes_per_token > STAGING_BUFFERS * STAGING_BUFFER_BYTES
    data = torch.randn(layout.host_shape(n), generator=torch.Generator().manual_seed(5)).to(layout.dtype)
    uploads = StreamUploads(kv)
    # Work still queued on the main stream for slot 1 when the restore begins: it must land before the rows.
    torch.cuda._sleep(200_000_000)
    kv.stages[0].k[:, 1].fill_(7)
    upload = uploads.begin(1)
    assert not upload.landed()

    def reader() -> None:
        for start in range(0, n, 64):
            upload.write(start, data[:, :, start : start + 64].clone())  # a temporary, as a disk read gives
        upload.finish()

    worker = threading.Thread(target=reader)
    worker.start()
    worker.join()
    assert upload.landed()
    upload.join()
    assert torch.equal(kv.read(1, 0, n), data)
    assert kv.read(0, 0, n).abs().sum() == 0  # the other slot untouched
