"""Priority and pinning in the conversation cache: one eviction order under every budget of every tier, refusals
that leave the survivors untouched, attributes that survive a restart, and read-only lookups between siblings."""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import pytest
import torch

from engine.atomic import publish, write_temp
from engine.cache import CacheRestoreError
from engine.cache.attrs import ConvAttrs
from engine.cache.fileformat import encode_header, file_chunks, read_header, read_tensor
from engine.cache.index import Conv, TierIndex
from engine.cache.policy import eviction_order, plan_room
from tests.test_cache_support import BLOCK, MODEL, FakeSlots, conversation, identity, make_cache, park_tokens

N_TOKENS = 4 * BLOCK


def _conv(cid: str, priority: str = "normal", pinned: bool = False, nbytes: int = 10) -> Conv:
    conv = Conv(cid, torch.zeros(0, dtype=torch.int32).numpy(), [], nbytes)
    conv.priority, conv.pinned = priority, pinned
    return conv


def test_eviction_order_is_unpinned_first_then_low_normal_high_then_least_recently_used():
    lru_first = [
        SimpleNamespace(id=cid, priority=p, pinned=pin, name="", client="", last_used=0.0)
        for cid, p, pin in [
            ("h-old", "high", False), ("pin-low", "low", True), ("n-old", "normal", False),
            ("l-old", "low", False), ("pin-high", "high", True), ("n-new", "normal", False),
            ("l-new", "low", False), ("h-new", "high", False), ("pin-low-new", "low", True),
        ]
    ]
    order = [c.id for c in eviction_order(lru_first)]
    assert order == ["l-old", "l-new", "n-old", "n-new", "h-old", "h-new", "pin-low", "pin-low-new", "pin-high"]


def test_plan_room_never_takes_a_higher_priority_entry_and_says_why():
    index = TierIndex("ram")
    for conv in (_conv("high", "high"), _conv("normal"), _conv("low", "low")):
        index.add(conv, [])
    common = dict(need_bytes=10, budget=30, slots=10, keep_keys=set(), leaving=set(), exclude=set())
    assert plan_room(index, rank=1, **common).victims == ["low"]
    assert plan_room(index, rank=0, **common).victims == ["low"]
    index.remove("low")
    index.add(_conv("low2", "low"), [])
    # needing two entries' room: a low park may take only the low one, so nothing is taken at all
    two = dict(common, need_bytes=20)
    refused = plan_room(index, rank=0, **two)
    assert not refused.ok and refused.refused == "priority" and refused.victims == []
    assert plan_room(index, rank=1, **two).victims == ["low2", "normal"]
    assert plan_room(index, rank=None, **dict(two, need_bytes=40), best_effort=True).refused == "no_room"


# ---------------------------------------------------------------------------------------------- every budget


class Scenario:
    """Parks into a cache whose budget holds exactly three of these conversations, and reads what is left."""

    def __init__(self, cache, tier: str) -> None:
        self.cache, self.tier, self.slots = cache, tier, FakeSlots()
        self.tokens: dict[str, list[int]] = {}
        self.ids: dict[str, str] = {}
        self.seed = 0

    def park(self, label: str, priority: str = "normal", pinned: bool = False):
        self.seed += 1
        tokens = conversation(1000 + self.seed, N_TOKENS)
        result = park_tokens(self.cache, self.slots, tokens, attrs=ConvAttrs(priority, pinned))
        if result.parked:
            self.tokens[label], self.ids[label] = tokens, result.conversation_id
        return result

    def left(self) -> set[str]:
        by_id = {v: k for k, v in self.ids.items()}
        return {by_id[r.id] for r in self.cache.conversations() if r.tier == self.tier}

    def pin(self, label: str) -> None:
        self.cache.set_attrs(self.ids[label], pinned=True)

    def restores_exactly(self, label: str) -> None:
        tokens = self.tokens[label]
        hit = self.cache.lookup(tokens + [7])
        assert hit is not None and hit.n_tokens == len(tokens), (label, hit)
        self.slots.kv.clear(1)
        self.cache.restore(hit, self.slots.writer(1))
        self.slots.fill(0, tokens)
        assert torch.equal(self.slots.kv.read(1, 0, len(tokens)), self.slots.snapshot(0, len(tokens)))


def _one_conversation_bytes(storage: str, tmp_path) -> int:
    probe = make_cache(storage=storage, dir=str(tmp_path / "probe"))
    park_tokens(probe, FakeSlots(), conversation(1, N_TOKENS))
    assert probe.flush(10)
    st = probe.stats()
    probe.close(spill=False)
    return st.bytes_disk if storage == "disk" else st.bytes_ram


BUDGETS = [("ram", "bytes"), ("ram", "slots"), ("disk", "bytes"), ("disk", "slots"), ("tiered", "bytes"),
           ("tiered", "slots")]


@pytest.mark.parametrize(("storage", "budget"), BUDGETS, ids=[f"{s}-{b}" for s, b in BUDGETS])
def test_eviction_order_by_priority_and_pin_under_each_budget(storage, budget, tmp_path):
    tier = "disk" if storage == "disk" else "ram"
    kw: dict = {"storage": storage, "dir": str(tmp_path / "cache") if storage != "ram" else ""}
    if budget == "slots":
        kw["slots"] = 3
    else:
        size = _one_conversation_bytes("disk" if storage == "disk" else "ram", tmp_path)
        kw["disk_bytes" if storage == "disk" else "ram_bytes"] = 3 * size + size // 2
    cache = make_cache(**kw)
    s = Scenario(cache, tier)
    for label, priority in (("H", "high"), ("N1", "normal"), ("L", "low")):
        assert s.park(label, priority).parked
    assert s.left() == {"H", "N1", "L"}
    assert s.park("N2").parked
    assert s.left() == {"H", "N1", "N2"}, "the low one goes first, though it was used last"
    assert s.park("N3").parked
    assert s.left() == {"H", "N2", "N3"}, "least recently used within a priority, never the older high one"

    before = cache.stats()
    low = s.park("L2", "low")
    if storage == "tiered":  # RAM full of higher priorities: the disk takes it
        assert low.parked and low.tier == "disk"
    else:
        assert not low.parked and low.reason == "priority"
        after = cache.stats()
        assert after.refusals.get("priority", 0) == before.refusals.get("priority", 0) + 1
        assert after.evictions == before.evictions
        # The latest refusal: a disk writer's event for an earlier park may land after it.
        refusals = [e for e in cache.events(1) if e["kind"] == "refuse"]
        assert refusals and refusals[-1]["reason"] == "priority"
    assert s.left() == {"H", "N2", "N3"}
    for label in ("H", "N2", "N3"):
        s.restores_exactly(label)  # the refusal left every survivor as it was

    s.pin("N2")
    assert s.park("N4").parked
    assert s.left() == {"H", "N2", "N4"}, "a pinned conversation goes after every unpinned one of its priority"
    assert s.park("H2", "high").parked
    assert s.left() == {"H", "N2", "H2"}
    assert s.park("H3", "high").parked
    assert s.left() == {"N2", "H2", "H3"}, "an unpinned high one goes before a pinned normal one"
    s.pin("H2")
    s.pin("H3")
    assert s.park("H4", "high").parked
    assert s.left() == {"H2", "H3", "H4"}, "with nothing unpinned left, the lowest pinned one goes"
    if storage == "tiered" and budget == "bytes":  # what RAM evicted was spilled, not lost (disk: no cap)
        assert cache.flush(10)
        on_disk = {r.id for r in cache.conversations() if r.tier == "disk"}
        assert {s.ids[k] for k in ("N1", "L", "N3", "N4", "H", "N2", "L2")} <= on_disk
    cache.close(spill=False)


def test_tiered_disk_budget_refuses_a_low_park_and_drops_a_low_spill_not_the_high_ones(tmp_path):
    size = _one_conversation_bytes("disk", tmp_path)
    ram = _one_conversation_bytes("ram", tmp_path)
    cache = make_cache(storage="tiered", dir=str(tmp_path / "c"), ram_bytes=ram + ram // 2,
                       disk_bytes=2 * size + size // 2)
    s = Scenario(cache, "disk")
    for label in ("H1", "H2", "H3"):  # H1 and H2 spill to disk, H3 stays in RAM
        assert s.park(label, "high").parked
    assert cache.flush(10)
    assert s.left() == {"H1", "H2"}
    low = s.park("L", "low")  # RAM and disk both hold only higher priorities
    assert not low.parked and low.reason == "priority"
    assert cache.stats().refusals["priority"] == 1
    assert cache.flush(10)
    for label in ("H1", "H2", "H3"):
        s.restores_exactly(label)
    cache.close(spill=False)


# ---------------------------------------------------------------------------------------------- attributes


def test_attributes_are_kept_by_the_line_and_survive_a_restart(tmp_path):
    slots, where = FakeSlots(), str(tmp_path)
    cache = make_cache(storage="disk", dir=where)
    first = conversation(5, 2 * BLOCK + 3)
    cid = park_tokens(cache, slots, first, attrs=ConvAttrs("high", True, "Fix the parser", "aider/0.8",
                                                                  "You are a careful coder")).conversation_id
    # the next turn says nothing about priority or pin: it keeps the line's, and its name
    longer = park_tokens(cache, slots, first + [1, 2, 3, 4], attrs=ConvAttrs(name="other words", client="x",
                                                                     system="other system"))
    assert longer.conversation_id == cid
    assert cache.set_attrs(cid, priority="low") == cid
    assert cache.flush(10)
    cache.close(spill=False)
    again = make_cache(storage="disk", dir=where)
    [row] = again.conversations()
    assert (row.id, row.priority, row.pinned, row.name, row.client) == (cid, "low", True, "Fix the parser", "x")
    assert row.system == "You are a careful coder", "the system words stay those the line started with"
    with pytest.raises(KeyError):
        again.set_attrs("0123456789abcdef", pinned=False)
    with pytest.raises(ValueError, match="priority: expected one of low, normal, high, got 'urgent'"):
        again.set_attrs(cid, priority="urgent")
    again.close(spill=False)


def test_a_manifest_without_attributes_reads_as_normal_and_unpinned(tmp_path):
    slots, where = FakeSlots(), str(tmp_path)
    cache = make_cache(storage="disk", dir=where)
    cid = park_tokens(cache, slots, conversation(6, 2 * BLOCK + 3), attrs=ConvAttrs("high", True, "n", "c"))
    folder = cache.stats().dir
    cache.close(spill=True)
    [path] = [os.path.join(folder, n) for n in os.listdir(folder) if n.startswith("conv-")]
    with open(path, "rb", buffering=0) as f:
        header = read_header(f)
        tensors = [(name, read_tensor(f, header, name)) for name in header.tensors]
    assert header.meta["priority"] == "high" and header.meta["pinned"] == "true"
    meta = {k: v for k, v in header.meta.items() if k not in ("priority", "pinned", "name", "client", "system")}
    tmp, _ = write_temp(path, file_chunks(encode_header(tensors, meta), tensors))
    publish([(tmp, path)])
    again = make_cache(storage="disk", dir=where)
    [row] = again.conversations()
    assert (row.id, row.priority, row.pinned, row.name, row.client) == (cid.conversation_id, "normal", False, "", "")
    again.close(spill=False)


# ---------------------------------------------------------------------------------------------- read-only lookups


@pytest.mark.parametrize("storage", ["ram", "disk", "tiered"])
def test_restoring_one_sibling_leaves_the_other_parked_and_restorable(storage, tmp_path):
    cache = make_cache(storage=storage, dir=str(tmp_path) if storage != "ram" else "")
    slots = FakeSlots()
    shared = conversation(7, 3 * BLOCK + 5)
    a = conversation(8, 5 * BLOCK, prefix=shared)
    b = conversation(9, 5 * BLOCK + 7, prefix=shared)
    ids = [park_tokens(cache, slots, t).conversation_id for t in (a, b)]
    assert ids[0] != ids[1]
    s = Scenario(cache, "")
    s.slots, s.tokens = slots, {"a": a, "b": b}
    for _ in range(2):  # restoring either, in turn, never consumes the other
        s.restores_exactly("a")
        s.restores_exactly("b")
    # a continuation of `a` replaces `a` only, never its sibling
    assert park_tokens(cache, slots, a + [5, 6, 7]).conversation_id == ids[0]
    assert {r.id for r in cache.conversations()} == set(ids)
    s.restores_exactly("b")
    assert cache.stats().restore_failures == 0
    cache.close(spill=False)


def test_a_hit_is_the_exact_common_tokens_under_the_model_identity():
    cache, slots = make_cache(), FakeSlots()
    tokens = conversation(10, 3 * BLOCK + 9)
    park_tokens(cache, slots, tokens)
    for at in (0, 5, BLOCK, 2 * BLOCK + 3, 3 * BLOCK + 4):  # one token differs: the hit ends right there
        changed = list(tokens) + [1]
        changed[at] = (changed[at] + 1) % 32000
        hit = cache.lookup(changed)
        assert (hit.n_tokens if hit else 0) == at, at
    # the same tokens parked under another model identity (another tokenizer) are not this cache's
    foreign = make_cache(identity(model={**MODEL, "tokenizer": "tok-2"}))
    park_tokens(foreign, slots, tokens)
    hit = foreign.lookup(tokens + [1])
    assert hit is not None and hit.identity_key != cache.identity.key
    with pytest.raises(CacheRestoreError, match="another model identity"):
        cache.restore(hit, slots.writer(1))


def test_a_restore_holds_exactly_the_tokens_its_hit_was_made_for():
    cache, slots = make_cache(), FakeSlots()
    a, b = conversation(11, 3 * BLOCK + 2), conversation(12, 3 * BLOCK + 2)
    id_a = park_tokens(cache, slots, a).conversation_id
    park_tokens(cache, slots, b)
    hit_b = cache.lookup(b + [1])
    # the same promise under another conversation's id: refused before a byte reaches the slot
    wrong = dataclasses.replace(hit_b, conversation_id=id_a)
    slots.kv.clear(1)
    with pytest.raises(CacheRestoreError, match="no longer holds the hit's tokens"):
        cache.restore(wrong, slots.writer(1))
    assert not slots.kv.read(1, 0, len(b)).any()
    assert cache.restore(hit_b, slots.writer(1)).n_tokens == len(b)


def test_a_change_while_the_entry_is_being_written_reaches_its_manifest(tmp_path):
    from tests.test_cache_writer import _while_being_written

    cache, slots = make_cache(storage="disk", dir=str(tmp_path), disk_bytes=1 << 30), FakeSlots(ctx=8192)
    _, _, cid = _while_being_written(cache, slots, 280, lambda tokens, cid: cache.set_attrs(cid, priority="high",
                                                                                             pinned=True))
    assert cache.flush(30)
    cache.close(spill=False)
    again = make_cache(storage="disk", dir=str(tmp_path), disk_bytes=1 << 30)
    assert {(r.id, r.priority, r.pinned) for r in again.conversations()} >= {(cid, "high", True)}
    again.close(spill=False)
