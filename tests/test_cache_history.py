"""A parked conversation's history (created, last used, hits) survives a restart and a crash on the same folder."""

from __future__ import annotations

import os
import time

from engine.atomic import publish, write_temp
from engine.cache.fileformat import encode_header, file_chunks, read_header, read_tensor
from tests.cache_faults import SPAWN, run_child
from tests.test_cache_support import BLOCK, FakeSlots, conversation, make_cache, park_tokens


def _restore(cache, slots: FakeSlots, tokens: list[int]) -> str:
    hit = cache.lookup(tokens + [7])
    assert hit is not None and hit.n_tokens == len(tokens), hit
    slots.kv.clear(1)
    return cache.restore(hit, slots.writer(1)).tier


def _rows(cache) -> dict[str, tuple[float, float, int, str]]:
    return {c.id: (c.created, c.last_used, c.hits, c.tier) for c in cache.conversations()}


def _manifests(folder: str) -> list[str]:
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.startswith("conv-"))


def test_distinct_last_use_and_hits_survive_a_restart_whatever_the_files_mtimes(tmp_path):
    for mode in ("disk", "tiered"):
        slots, where = FakeSlots(), str(tmp_path / mode)
        cache = make_cache(storage=mode, dir=where)
        a, b = conversation(1, 4 * BLOCK + 5), conversation(2, 3 * BLOCK + 9)
        id_a = park_tokens(cache, slots, a).conversation_id
        id_b = park_tokens(cache, slots, b).conversation_id
        assert cache.flush(10)
        _restore(cache, slots, a)
        _restore(cache, slots, a)  # A: two hits, used after B was parked
        before = _rows(cache)
        assert before[id_a][2] == 2 and before[id_b][2] == 0 and before[id_a][1] > before[id_b][1]
        folder = cache.stats().dir
        cache.close(spill=True)  # tiered: both reach the disk here, with their history
        same = time.time() - 60  # one mtime for every file (a copy, a backup restore): it must not matter
        for path in _manifests(folder):
            os.utime(path, (same, same))
        again = make_cache(storage=mode, dir=where)
        after = _rows(again)
        assert set(after) == {id_a, id_b}, (mode, after)
        for cid in (id_a, id_b):
            assert after[cid][:3] == before[cid][:3], (mode, cid, before[cid], after[cid])
            assert after[cid][3] == "disk"
        assert [c.id for c in again.conversations()] == [id_a, id_b]  # most recently used first
        again.close(spill=False)


def _restore_then_die(_report, where: str, tokens: list[int]) -> int:
    """In a child: restore `tokens` from disk; the child then ends without closing the cache (as a crash or a kill
    does: tests/cache_faults.py `run_child`)."""
    cache = make_cache(storage="disk", dir=where)
    return 0 if _restore(cache, FakeSlots(), tokens) == "disk" else 1


def test_a_restore_from_disk_is_remembered_after_a_crash(tmp_path):
    slots, where, tokens = FakeSlots(), str(tmp_path), conversation(3, 5 * BLOCK + 2)
    cache = make_cache(storage="disk", dir=where)
    cid = park_tokens(cache, slots, tokens).conversation_id
    cache.close(spill=True)
    first = make_cache(storage="disk", dir=where)
    created, parked_at, hits, _ = _rows(first)[cid]
    assert hits == 0
    first.close(spill=False)
    assert run_child(_restore_then_die, where, tokens, method=SPAWN)[0] == 0
    again = make_cache(storage="disk", dir=where)
    row = _rows(again)[cid]
    assert row[0] == created and row[1] > parked_at and row[2] == 1, row
    assert _restore(again, slots, tokens) == "disk"  # the rewritten manifest restores like the original
    again.close(spill=False)
    third = make_cache(storage="disk", dir=where)
    assert _rows(third)[cid][2] == 2
    third.close(spill=False)


def test_a_manifest_without_last_used_falls_back_to_its_mtime(tmp_path):
    """Files written before `last_used` existed stay readable: their last use is the file's time, as it was."""
    slots, where = FakeSlots(), str(tmp_path)
    cache = make_cache(storage="disk", dir=where)
    cid = park_tokens(cache, slots, conversation(4, 2 * BLOCK + 3)).conversation_id
    folder = cache.stats().dir
    cache.close(spill=True)
    [path] = _manifests(folder)
    with open(path, "rb", buffering=0) as f:
        header = read_header(f)
        tensors = [(name, read_tensor(f, header, name)) for name in header.tensors]
    meta = {k: v for k, v in header.meta.items() if k != "last_used"}
    tmp, _ = write_temp(path, file_chunks(encode_header(tensors, meta), tensors))
    publish([(tmp, path)])
    os.utime(path, (1_500_000_000, 1_500_000_000))
    again = make_cache(storage="disk", dir=where, days=365 * 100)
    [row] = again.conversations()
    assert row.id == cid and row.last_used == 1_500_000_000 and row.hits == 0
    again.close(spill=False)


def test_a_restore_while_the_entry_is_being_written_reaches_its_manifest(tmp_path):
    from tests.test_cache_writer import _while_being_written

    cache, slots = make_cache(storage="disk", dir=str(tmp_path), disk_bytes=1 << 30), FakeSlots(ctx=8192)
    tier, tokens, cid = _while_being_written(cache, slots, 270, lambda tokens, cid: _restore(cache, slots, tokens))
    assert tier == "disk"
    assert cache.flush(30)
    hits = {c.id: c.hits for c in cache.conversations()}
    assert hits[cid] == 1
    cache.close(spill=False)
    again = make_cache(storage="disk", dir=str(tmp_path), disk_bytes=1 << 30)
    assert {c.id: c.hits for c in again.conversations()} == hits
    again.close(spill=False)
