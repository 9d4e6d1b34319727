"""The Settings tab's eviction question against the engine's cache: the conversations the estimate names are the
ones a real ConversationCache drops when the change is applied (engine/cache/reconfigure.py)."""

from __future__ import annotations

import dataclasses
import time

from desktop import eviction
from desktop.monitor.conversations import merge_tiers
from engine.cache.attrs import ConvAttrs
from engine.contract import ConversationRow
from tests.test_cache_support import BLOCK, FakeSlots, conversation, make_cache, park_tokens

MIB = 1 << 20
N_TOKENS = 8 * BLOCK
LABELS = [("pinned", "normal", True), ("high", "high", False), ("normal", "normal", False), ("low", "low", False)]


def _park_four(cache) -> dict[str, str]:
    """Four conversations of one size, least recently used first; returns id -> label."""
    slots, labels = FakeSlots(), {}
    for seed, (label, priority, pinned) in enumerate(LABELS):
        result = park_tokens(cache, slots, conversation(100 + seed, N_TOKENS), attrs=ConvAttrs(priority, pinned))
        assert result.parked
        labels[result.conversation_id] = label
    return labels


def _rows(cache):
    return merge_tiers([ConversationRow(**info.to_dict()) for info in cache.conversations()])


def _running(settings) -> dict:
    return {"conversation_cache_mib": settings.ram_bytes / MIB, "conversation_cache_disk_mib": settings.disk_bytes / MIB,
            "conversation_cache_slots": settings.slots}


def _left(cache, labels: dict[str, str], tier: str) -> set[str]:
    return {labels[r.id] for r in cache.conversations() if r.tier == tier and r.id in labels}


def test_switch_to_disk_names_what_the_engine_drops(tmp_path):
    """ram -> disk with room on disk for two: the RAM conversations are written one by one, least recently used
    first, each making room as a spill does; "low", written last, may push out none of the others."""
    probe = make_cache(storage="disk", dir=str(tmp_path / "probe"))
    park_tokens(probe, FakeSlots(), conversation(1, N_TOKENS))
    assert probe.flush(10)
    on_disk = probe.stats().bytes_disk  # a block file's header and alignment: more than its RAM bytes
    probe.close(spill=False)
    cache = make_cache(storage="ram", dir=str(tmp_path / "cache"))
    labels = _park_four(cache)
    in_ram = cache.stats().bytes_ram / 4
    # two fit on disk, and three do not by their RAM bytes either (what the estimate counts)
    settings = dataclasses.replace(cache.settings, disk_bytes=int(2.2 * on_disk))
    assert 2 * on_disk <= settings.disk_bytes < 3 * in_ram
    cache.reconfigure(dataclasses.replace(cache.settings, disk_bytes=settings.disk_bytes))
    rows = _rows(cache)
    [estimate] = eviction.estimate(rows, "ram", _running(settings), {"conversation_cache_storage": "disk"})
    assert {labels[i] for i in estimate.ids} == {"pinned", "low"}
    cache.reconfigure(dataclasses.replace(settings, storage="disk"))
    assert cache.flush(10)
    assert _left(cache, labels, "disk") == {"high", "normal"}
    cache.close(spill=False)


def test_tiered_slot_count_is_per_tier_as_in_the_engine(tmp_path):
    """Tiered, the slot count cut to 2: RAM keeps two and writes the other two to disk, which keeps two as well."""
    cache = make_cache(storage="tiered", dir=str(tmp_path / "cache"))
    labels = _park_four(cache)
    running = _running(cache.settings)
    evictions = eviction.estimate(_rows(cache), "tiered", running, {"conversation_cache_slots": 2})
    assert [e.where for e in evictions] == ["ram"], evictions
    assert {labels[i] for i in evictions[0].ids} == {"normal", "low"} and evictions[0].spilled
    cache.reconfigure(dataclasses.replace(cache.settings, slots=2))
    assert cache.flush(10)
    assert _left(cache, labels, "ram") == {"pinned", "high"}
    assert _left(cache, labels, "disk") == {"normal", "low"}
    cache.close(spill=False)


def _lost(cache, storage: str, changes: dict, settings, links: dict[str, str] | None = None):
    """(the ids the estimate says are dropped, the ids the engine no longer holds once `settings` are applied)."""
    raw = [ConversationRow(**info.to_dict()) for info in cache.conversations()]
    evictions = eviction.estimate(merge_tiers(raw, links), storage, _running(cache.settings), changes)
    cache.reconfigure(settings)
    assert cache.flush(10)
    left = {r.id for r in cache.conversations()}
    return {i for e in evictions if not e.spilled for i in e.ids}, {r.id for r in raw} - left


def _park(cache, slots, seed: int, blocks: int, **kw) -> str:
    result = park_tokens(cache, slots, conversation(seed, blocks * BLOCK), **kw)
    assert result.parked
    time.sleep(0.002)  # distinct last-use times
    return result.conversation_id


def test_a_smaller_tiered_ram_budget_moves_more_than_the_write_buffer_holds(tmp_path):
    """Six conversations move to disk at once, five times the write buffer: all are written, none dropped."""
    cache = make_cache(storage="tiered", dir=str(tmp_path), ram_bytes=4 * MIB, spill_queue_bytes=MIB)
    slots = FakeSlots()
    for seed in range(6):
        _park(cache, slots, seed, 32)
    estimated, lost = _lost(cache, "tiered", {"conversation_cache_mib": 1},
                            dataclasses.replace(cache.settings, ram_bytes=MIB))
    assert estimated == lost == set()
    assert cache.stats().spill_dropped == 0 and len([r for r in cache.conversations() if r.tier == "disk"]) == 5
    cache.close(spill=False)


def test_disk_evictions_go_by_last_use_also_for_a_conversation_spilled_late(tmp_path):
    """"old" reaches the disk after "big" (parked there straight, too large for RAM): it was used before, so a
    smaller disk budget drops it first, in the engine as in the estimate."""
    cache = make_cache(storage="tiered", dir=str(tmp_path), ram_bytes=MIB)
    slots = FakeSlots()
    old = _park(cache, slots, 1, 32)
    big = _park(cache, slots, 2, 80)
    _park(cache, slots, 3, 32)
    _park(cache, slots, 4, 32)  # "old" is spilled now, after "big"
    assert cache.flush(10)
    assert list(cache.disk.index.convs)[:2] == [big, old], "the disk's index in the order of arrival"
    budget = cache.stats().bytes_disk / MIB - 0.3
    estimated, lost = _lost(cache, "tiered", {"conversation_cache_disk_mib": budget},
                            dataclasses.replace(cache.settings, disk_bytes=int(budget * MIB)))
    assert estimated == lost == {old}
    cache.close(spill=False)


def _restore_from_disk(cache, slots, tokens: list[int], slot: int) -> None:
    hit = cache.lookup(tokens + conversation(3, 2 * BLOCK))
    assert hit is not None and hit.tier == "disk"
    cache.restore(hit, slots.writer(slot))  # a use: its last-use time is now
    time.sleep(0.002)


def test_a_disk_copy_is_weighed_by_its_own_pin_and_last_use(tmp_path):
    """X restored from disk goes on as Z (the Monitor merges them) and Z is pinned; W is restored after that. X's
    disk copy is not pinned and was last used before W, so a disk budget for one of the two drops X."""
    cache = make_cache(storage="tiered", dir=str(tmp_path), ram_bytes=700 << 10)  # RAM holds one
    slots = FakeSlots()
    x, w = conversation(1, 32 * BLOCK), conversation(2, 32 * BLOCK)
    first = _park(cache, slots, 1, 32)
    other = _park(cache, slots, 2, 32)  # X is spilled
    assert cache.flush(10)
    _restore_from_disk(cache, slots, x, 1)
    going_on = park_tokens(cache, slots, x + conversation(3, 2 * BLOCK), slot=1).conversation_id  # W is spilled
    assert cache.flush(10)
    cache.set_attrs(going_on, pinned=True)
    _restore_from_disk(cache, slots, w, 0)
    budget = cache.stats().bytes_disk / MIB - 0.3
    estimated, lost = _lost(cache, "tiered", {"conversation_cache_disk_mib": budget},
                            dataclasses.replace(cache.settings, disk_bytes=int(budget * MIB)), {first: going_on})
    assert estimated == lost == {first} and other not in lost
    cache.close(spill=False)


def test_a_tiered_ram_budget_of_0_writes_every_ram_conversation_to_disk(tmp_path):
    """RAM unused: the engine writes its conversations to disk least recently used first, whatever their pin; a
    single slot keeps the newest."""
    cache = make_cache(storage="tiered", dir=str(tmp_path))
    slots = FakeSlots()
    pinned = _park(cache, slots, 1, 32, attrs=ConvAttrs("normal", True))
    newer = _park(cache, slots, 2, 32)
    estimated, lost = _lost(cache, "tiered", {"conversation_cache_mib": 0, "conversation_cache_slots": 1},
                            dataclasses.replace(cache.settings, ram_bytes=0, slots=1))
    assert estimated == lost == {pinned} and newer not in lost
    cache.close(spill=False)


def test_disk_storage_with_a_disk_budget_of_0_is_asked_about(tmp_path):
    """Disk storage with no disk budget keeps nothing: every RAM conversation is dropped, and the question says
    why."""
    cache = make_cache(storage="ram", dir=str(tmp_path), disk_bytes=0)
    slots = FakeSlots()
    ids = {_park(cache, slots, seed, 32) for seed in range(3)}
    raw = [ConversationRow(**info.to_dict()) for info in cache.conversations()]
    [gone] = eviction.estimate(merge_tiers(raw), "ram", _running(cache.settings), {"conversation_cache_storage": "disk"})
    assert "a budget of 0 leaves its tier unused" in eviction.describe([gone])
    estimated, lost = _lost(cache, "ram", {"conversation_cache_storage": "disk"},
                            dataclasses.replace(cache.settings, storage="disk"))
    assert estimated == lost == ids
    cache.close(spill=False)


def test_a_queued_write_does_not_count_the_copy_it_replaces(tmp_path):
    """X restored from disk goes on as Z; a RAM budget cut writes Z (replacing X) and the other to four disk
    slots: the engine counts X as leaving once Z is queued, so nothing that fits is dropped, as the estimate says."""
    cache = make_cache(storage="tiered", dir=str(tmp_path), ram_bytes=1126 << 10, slots=4)
    slots = FakeSlots()
    x = conversation(2, 32 * BLOCK)
    _park(cache, slots, 1, 32)
    first = _park(cache, slots, 2, 32)
    _park(cache, slots, 3, 32)
    _park(cache, slots, 4, 32)  # the first two are spilled
    assert cache.flush(10)
    _restore_from_disk(cache, slots, x, 1)
    going_on = park_tokens(cache, slots, x + conversation(3, 2 * BLOCK), slot=1).conversation_id
    assert cache.flush(10)
    estimated, lost = _lost(cache, "tiered", {"conversation_cache_mib": 0.1},
                            dataclasses.replace(cache.settings, ram_bytes=MIB // 10), {first: going_on})
    assert estimated == set() and lost == {first}, "nothing lost: X's id is gone, replaced by Z"
    assert len([r for r in cache.conversations() if r.tier == "disk"]) == 4
    cache.close(spill=False)
