"""The Settings tab's eviction question against the engine's cache: the conversations the estimate names are the
ones a real ConversationCache drops when the change is applied (engine/cache/reconfigure.py)."""

from __future__ import annotations

import dataclasses

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
