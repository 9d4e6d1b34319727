"""Disk mode's background writer (bounded staging, RAM copies until written, failed writes), purge of entries
being written, and the restore cost model."""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path

from engine.cache.lifecycle import EntryState
from tests.cache_faults import no_file_size_limit_on_windows
from tests.test_cache_disk import _in_child, check_restores, folder_of, our_files
from tests.test_cache_support import BLOCK, LAYOUT, FakeSlots, conversation, make_cache, park_tokens

BPT = LAYOUT.bytes_per_token


def test_disk_park_returns_before_the_write_and_is_served_from_its_ram_copy(tmp_path):
    cache, slots = make_cache(storage="disk", dir=str(tmp_path)), FakeSlots()
    a = conversation(200, 7 * BLOCK + 5)
    grown = conversation(201, len(a) + 2 * BLOCK + 3, a)
    with cache.lock:  # the writer needs this lock: nothing can be written while the test holds it
        first = park_tokens(cache, slots, a)  # returns all the same: a park never waits on the disk
        assert first.parked and first.tier == "disk"
        assert our_files(folder_of(cache)) == []
        st = cache.stats()
        assert st.bytes_pending == first.new_bytes == 7 * BLOCK * BPT + 5 * BPT
        assert [c.pending for c in cache.conversations()] == [True]
        check_restores(cache, slots, a)  # from the RAM copy: no file exists yet
        second = park_tokens(cache, slots, grown)  # re-park while the first is still pending: one entry
        assert second.conversation_id == first.conversation_id and len(cache.conversations()) == 1
        check_restores(cache, slots, grown)
        assert our_files(folder_of(cache)) == []
    assert cache.flush(10)
    files = our_files(folder_of(cache))
    assert sum(f.startswith("conv-") for f in files) == 1 and sum(f.startswith("blk-") for f in files) == 9
    st = cache.stats()
    assert st.bytes_pending == 0 and st.spills == 1 and not cache.conversations()[0].pending
    check_restores(cache, slots, grown)  # now from its files
    cache.close(spill=False)


def test_disk_staging_is_bounded_dropping_the_oldest_pending_write(tmp_path):
    conv_bytes = 6 * BLOCK * BPT
    cache = make_cache(storage="disk", dir=str(tmp_path), spill_queue_bytes=int(2.5 * conv_bytes))
    slots = FakeSlots()
    convs = [conversation(210 + i, 6 * BLOCK) for i in range(4)]
    with cache.lock:  # hold the writer back: every park stays pending
        ids = [park_tokens(cache, slots, t).conversation_id for t in convs]  # none of them blocks
        st = cache.stats()
        assert st.spill_dropped == 2 and st.bytes_pending == 2 * conv_bytes
        assert sorted(c.id for c in cache.conversations()) == sorted(ids[2:])  # the two oldest went
    assert cache.flush(10)
    assert cache.lookup(convs[0] + [1]) is None
    for t in convs[2:]:
        check_restores(cache, slots, t)
    # a park bigger than the whole bound is written before it returns, never staged
    big = conversation(220, 20 * BLOCK)
    assert park_tokens(cache, slots, big).parked and cache.stats().bytes_pending == 0
    assert not cache.conversations()[0].pending
    cache.close(spill=False)


def test_close_writes_pending_parks_within_its_deadline(tmp_path):
    cache, slots = make_cache(storage="disk", dir=str(tmp_path)), FakeSlots()
    convs = [conversation(230 + i, 5 * BLOCK + i) for i in range(3)]
    with cache.lock:
        ids = [park_tokens(cache, slots, t).conversation_id for t in convs]
    cache.close(spill=False, deadline_s=30)
    again = make_cache(storage="disk", dir=str(tmp_path))
    assert sorted(c.id for c in again.conversations()) == sorted(ids)
    for t in convs:
        check_restores(again, slots, t)
    again.close(spill=False)


@no_file_size_limit_on_windows
def test_failed_background_write_is_counted_logged_and_keeps_the_written_version(tmp_path, caplog):
    import resource
    import signal

    slots = FakeSlots()
    a = conversation(240, 5 * BLOCK + 2)
    grown = conversation(241, len(a) + 4 * BLOCK, a)

    def failing_repark() -> bool:
        cache = make_cache(storage="disk", dir=str(tmp_path))
        cid = park_tokens(cache, slots, a).conversation_id
        assert cache.flush(10)
        folder = folder_of(cache)
        before = {n: Path(folder, n).read_bytes() for n in our_files(folder)}
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (6000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        with caplog.at_level(logging.WARNING, logger="strata.cache"):
            r = park_tokens(cache, slots, grown)  # the same conversation line: replaces A once written
            assert r.parked and r.conversation_id == cid
            assert not cache.flush(10)
        st = cache.stats()
        assert st.spill_failed == 1 and st.bytes_pending == 0
        assert (
            f"writing {cid} to disk failed" in caplog.text
            and "previously written version is kept" in caplog.text
        )
        # what was on disk is untouched, indexed again, and restores
        assert {n: Path(folder, n).read_bytes() for n in our_files(folder)} == before
        assert [(c.id, c.tokens, c.pending) for c in cache.conversations()] == [(cid, len(a), False)]
        check_restores(cache, slots, a)
        assert not any(".tmp-" in n for n in os.listdir(folder))
        cache.close(spill=False)
        return True

    assert _in_child(failing_repark) == 0
    again = make_cache(storage="disk", dir=str(tmp_path))
    check_restores(again, slots, a)
    again.close(spill=False)


@no_file_size_limit_on_windows
def test_a_failed_write_shows_in_disk_error_until_a_later_write_succeeds(tmp_path):
    import re
    import resource
    import signal

    slots = FakeSlots()
    stamp = re.compile(r"at \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ")

    def full_then_freed() -> bool:
        cache = make_cache(storage="disk", dir=str(tmp_path))
        big = make_cache(storage="disk", dir=str(tmp_path / "big"), spill_queue_bytes=0)  # writes before returning
        assert cache.stats().disk_error == big.stats().disk_error == ""
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (6000, limit[1]))  # every block file is larger: EFBIG
        assert park_tokens(cache, slots, conversation(250, 5 * BLOCK)).parked  # its background write fails
        assert not cache.flush(10)
        refused = park_tokens(big, slots, conversation(251, 5 * BLOCK))
        background, now = cache.stats().disk_error, big.stats().disk_error
        assert not refused.parked and refused.reason == "disk_error"
        for error in (background, now):
            assert error.startswith("EFBIG (File too large): writing ") and stamp.search(error), error
            assert str(tmp_path) not in error  # the file by its name in the folder
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        assert park_tokens(cache, slots, conversation(252, 5 * BLOCK)).parked and cache.flush(10)
        assert park_tokens(big, slots, conversation(253, 5 * BLOCK)).parked
        assert cache.stats().disk_error == big.stats().disk_error == ""  # cleared by the writes that succeeded
        cache.close(spill=False)
        big.close(spill=False)
        return True

    assert _in_child(full_then_freed) == 0


def _while_being_written(cache, slots, seed: int, action):
    """Park 8 MiB conversations until one is caught mid-write; run `action(tokens, id)` then, holding the lock
    (the writer cannot finish that write while it is held). Returns (action's result, tokens, id)."""
    for attempt in range(40):
        tokens = conversation(seed + attempt, 500 * BLOCK)  # 8 MiB: a write of some milliseconds
        cid = park_tokens(cache, slots, tokens).conversation_id
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with cache.lock:
                conv = cache.disk.index.convs[cid]
                if conv.state is EntryState.WRITING:
                    return action(tokens, cid), tokens, cid
                if conv.on_disk:
                    break  # written before we looked: try another
    raise AssertionError("never saw a write in flight")


def test_repark_while_the_previous_version_is_being_written_keeps_one_entry(tmp_path):
    cache, slots = make_cache(storage="disk", dir=str(tmp_path), disk_bytes=1 << 30), FakeSlots(ctx=8192)

    def repark(tokens, cid):
        grown = conversation(1, len(tokens) + BLOCK + 3, tokens)
        r = park_tokens(cache, slots, grown)
        assert r.conversation_id == cid and [c.id for c in cache.conversations()] == [cid]
        check_restores(cache, slots, grown)  # its new part from RAM, while the older version is written
        return grown

    grown, _, cid = _while_being_written(cache, slots, 260, repark)
    assert cache.flush(30)
    folder = folder_of(cache)
    convs = [c for c in cache.conversations() if c.id == cid]
    assert len(convs) == 1 and convs[0].tokens == len(grown) and not convs[0].pending
    assert f"conv-{cid}.safetensors" in our_files(folder)
    check_restores(cache, slots, grown)
    cache.close(spill=False)
    again = make_cache(storage="disk", dir=str(tmp_path), disk_bytes=1 << 30)
    assert [c.tokens for c in again.conversations() if c.id == cid] == [len(grown)]
    check_restores(again, slots, grown)
    again.close(spill=False)


def test_purge_skips_a_conversation_being_written_and_it_survives(tmp_path):
    cache, slots = make_cache(storage="disk", dir=str(tmp_path), disk_bytes=1 << 30), FakeSlots(ctx=8192)
    result, tokens, cid = _while_being_written(cache, slots, 250, lambda tokens, cid: cache.purge("disk"))
    assert result.skipped == [(cid, "being written to or read from disk")]
    assert result.to_dict()["skipped"] == [{"id": cid, "reason": "being written to or read from disk"}]
    assert cache.flush(30)
    assert [c.id for c in cache.conversations()] == [cid]
    folder = folder_of(cache)
    assert f"conv-{cid}.safetensors" in our_files(folder)
    check_restores(cache, slots, tokens)
    assert cache.purge("disk").dropped == 1 and our_files(folder) == []
    cache.close(spill=False)


def test_cost_model_weighs_measured_disk_bandwidth_against_prefill_and_overrides_bite(tmp_path):
    cache, slots = make_cache(storage="disk", dir=str(tmp_path)), FakeSlots()
    tokens = conversation(300, 20 * BLOCK + 5)
    park_tokens(cache, slots, tokens)
    assert cache.flush(10)
    request = tokens + [7]
    check_restores(cache, slots, tokens)  # no prefill rate yet: the hit is used; this measures disk bandwidth
    bw = cache.stats().restore_bandwidth["disk"]
    n = len(tokens)
    read_bytes = math.ceil(n / BLOCK) * BLOCK * BPT
    breakeven = (
        n * bw / read_bytes
    )  # the prefill rate at which prefilling n tokens takes as long as reading them
    cache.prefill_tokens_per_s = 1.1 * breakeven  # prefill is faster: restoring is not worth it
    assert cache.lookup(request) is None
    cache.prefill_tokens_per_s = 0.9 * breakeven  # prefill is slower: the hit is used
    hit = cache.lookup(request)
    assert hit is not None and hit.n_tokens == n and hit.tier == "disk"
    # only the tokens beyond what the slot already holds would be prefilled
    assert cache.lookup(request, live_prefix=n // 2) is None
    assert cache.stats().declined == {"cost": 2}
    # the user's thresholds decline hits the cost model would take
    cache.prefill_tokens_per_s = 0.1 * breakeven
    cache.reconfigure(cache.settings.replace(n_min=n + 1))
    assert cache.lookup(request) is None
    cache.reconfigure(cache.settings.replace(n_min=n))
    assert cache.lookup(request) is not None
    longer = tokens + conversation(301, n)  # the hit covers n of 2n tokens: similarity 0.5
    cache.reconfigure(cache.settings.replace(n_min=0, similarity=0.55))
    assert cache.lookup(longer) is None
    cache.reconfigure(cache.settings.replace(similarity=0.45))
    assert cache.lookup(longer).n_tokens == n
    assert cache.stats().declined == {"cost": 2, "n_min": 1, "similarity": 1}
    cache.close(spill=False)


def test_a_park_can_evict_a_conversation_being_written_and_its_files_go_when_the_write_ends(tmp_path):
    cache = make_cache(storage="disk", dir=str(tmp_path), disk_bytes=1 << 30, slots=1)
    slots = FakeSlots(ctx=8192)
    other = conversation(280, 5 * BLOCK + 1)

    def park_other(tokens, cid):
        r = park_tokens(cache, slots, other, slot=1)  # one slot: the entry being written must make way
        assert r.parked and r.evicted == 1 and [c.id for c in cache.conversations()] == [r.conversation_id]
        return r.conversation_id

    kept, _, evicted = _while_being_written(cache, slots, 270, park_other)
    assert cache.flush(30)
    assert cache.stats().evictions >= 1 and [c.id for c in cache.conversations()] == [kept]
    folder = folder_of(cache)
    files = our_files(folder)
    assert f"conv-{evicted}.safetensors" not in files and f"conv-{kept}.safetensors" in files
    assert sum(f.startswith("blk-") for f in files) == 5  # only the kept conversation's blocks
    check_restores(cache, slots, other)
    cache.close(spill=False)
    again = make_cache(storage="disk", dir=str(tmp_path), disk_bytes=1 << 30)
    assert [c.id for c in again.conversations()] == [kept]
    again.close(spill=False)


def test_a_park_written_at_once_over_a_queued_version_is_the_one_kept(tmp_path, monkeypatch):
    """A park too big for the staging bound is written before it returns, under the id of the same conversation's
    shorter version still queued for the writer: the writer must not write that version meanwhile (it would
    publish it over the longer one, and the index would hold two entries of one id)."""
    import threading

    import numpy as np

    from engine.cache.disk_tier import DiskTier
    from engine.cache.identity import block_keys

    cache = make_cache(storage="disk", dir=str(tmp_path), spill_queue_bytes=64 << 10)
    slots = FakeSlots()
    busy, short = conversation(290, BLOCK), conversation(291, 2 * BLOCK)
    grown = conversation(292, 12 * BLOCK + 3, short)
    busy_key = block_keys(cache.identity.key, np.array(busy, dtype=np.int32), BLOCK)[0]
    write_blocks = DiskTier.write_blocks
    busy_may_end, short_claimed, park_done = threading.Event(), threading.Event(), threading.Event()

    def paced(self, items, sync=True):  # the real writes, in an order that lets the writer claim `short` mid-park
        items = list(items)
        if threading.current_thread().name == "strata-cache-writer":
            if busy_key in [k for k, _ in items]:
                busy_may_end.wait(10)  # keeps `short` queued until the park below is under way
            else:
                short_claimed.set()
                park_done.wait(10)  # a claimed `short` would publish after the park
        else:
            busy_may_end.set()
            short_claimed.wait(1.0)  # time for the writer to claim `short`, which it must not
        return write_blocks(self, items, sync=sync)

    monkeypatch.setattr(DiskTier, "write_blocks", paced)
    assert park_tokens(cache, slots, busy).parked
    first = park_tokens(cache, slots, short)
    second = park_tokens(cache, slots, grown)  # 12 blocks: past the staging bound, written now
    park_done.set()
    assert second.parked and second.conversation_id == first.conversation_id
    assert cache.flush(30)
    check_restores(cache, slots, grown)
    cache.close(spill=False)
    again = make_cache(storage="disk", dir=str(tmp_path), spill_queue_bytes=64 << 10)
    assert sorted(c.tokens for c in again.conversations()) == [len(busy), len(grown)]  # the longer version
    again.close(spill=False)


def test_a_disk_park_never_evicts_a_conversation_a_restore_is_reading(tmp_path):
    cache = make_cache(storage="disk", dir=str(tmp_path), disk_bytes=200 << 10)
    slots = FakeSlots()
    a = conversation(300, 4 * BLOCK + 3)
    assert park_tokens(cache, slots, a).parked and cache.flush(10)
    read = cache.begin_restore(cache.lookup([*a, 7]))  # the reader thread's part of a restore, pending
    for i in range(3):  # each needs most of the budget: the reader's entry is the oldest
        assert park_tokens(cache, slots, conversation(310 + i, 4 * BLOCK + 3), slot=1).parked
        assert cache.flush(10)
    read.read()
    assert read.error is None, read.error
    assert any(c.tokens == len(a) for c in cache.conversations())
    cache.close(spill=False)
