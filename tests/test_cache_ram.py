"""The RAM tier: block keys, sharing, incremental re-parks, budgets, floor, read-only lookups, exact restores."""

from __future__ import annotations

import logging

import pytest
import torch

from engine.cache import CacheHit, CacheRestoreError, block_keys, token_array
from tests.test_cache_support import (
    BLOCK,
    LAYOUT,
    FakeSlots,
    conversation,
    identity,
    make_cache,
    park_tokens,
    run_python,
)

BPT = LAYOUT.bytes_per_token
BLOCK_BYTES = BLOCK * BPT


def restore_into(cache, slots, hit, slot=1, calls=None):
    slots.kv.clear(slot)
    return cache.restore(hit, slots.writer(slot, calls))


def test_block_keys_are_the_same_in_another_process_and_hash_seed():
    ident = identity()
    tokens = conversation(1, 200)
    here = block_keys(ident.key, token_array(tokens), BLOCK)
    code = (
        "from tests.test_cache_support import identity, conversation, BLOCK\n"
        "from engine.cache import block_keys, token_array\n"
        "i = identity(); print(i.key); print(','.join(block_keys(i.key, token_array(conversation(1, 200)), BLOCK)))"
    )
    out = run_python(code, env={"PYTHONHASHSEED": "12345"})
    assert out.returncode == 0, out.stderr
    key, keys = out.stdout.split()
    assert key == ident.key and keys.split(",") == here
    assert len(here) == 200 // BLOCK
    # the chain depends on the identity and on every earlier token
    other = identity(model={"architecture": "qwen2"})
    assert block_keys(other.key, token_array(tokens), BLOCK)[0] != here[0]
    changed = list(tokens)
    changed[0] += 1
    assert all(a != b for a, b in zip(block_keys(ident.key, token_array(changed), BLOCK), here, strict=True))


def test_restore_is_byte_identical_including_partial_blocks():
    cache, slots = make_cache(), FakeSlots()
    tokens = conversation(2, 10 * BLOCK + 5)
    assert park_tokens(cache, slots, tokens).parked
    parked = slots.snapshot(0, len(tokens))
    for n_request in (len(tokens) + 7, 3 * BLOCK + 9, 5):
        request = (
            tokens[: min(n_request, len(tokens))] + [1, 2, 3, 4, 5, 6, 7][: max(n_request - len(tokens), 0)]
        )
        hit = cache.lookup(request)
        assert hit is not None and hit.tier == "ram"
        assert hit.n_tokens == min(len(tokens), len(request) - 1)
        result = restore_into(cache, slots, hit)
        assert result.n_tokens == hit.n_tokens and result.nbytes == hit.n_tokens * BPT
        assert torch.equal(slots.kv.read(1, 0, hit.n_tokens), parked[:, :, : hit.n_tokens])
        assert not slots.kv.read(1, hit.n_tokens, len(tokens) + 8).any()  # nothing written past the hit


def test_hit_leaves_one_token_to_compute():
    cache, slots = make_cache(), FakeSlots()
    tokens = conversation(3, 4 * BLOCK)
    park_tokens(cache, slots, tokens)
    hit = cache.lookup(tokens)
    assert hit.n_tokens == len(tokens) - 1


def test_shared_prefix_is_stored_once():
    cache, slots = make_cache(), FakeSlots()
    system = conversation(4, 8 * BLOCK)
    a = conversation(5, 12 * BLOCK + 3, system)
    b = conversation(6, 11 * BLOCK + 7, system)
    park_tokens(cache, slots, a)
    second = park_tokens(cache, slots, b)
    assert second.new_bytes == 3 * BLOCK_BYTES + 7 * BPT  # only B's own blocks and tail were captured
    st = cache.stats()
    assert st.entries_ram == 2 and st.blocks_ram == 8 + 4 + 3
    expected = (8 + 4 + 3) * BLOCK_BYTES + 3 * BPT + 7 * BPT + 4 * (len(a) + len(b))
    assert st.bytes_ram == expected
    for tokens in (a, b):
        slots.fill(0, tokens)
        hit = cache.lookup(tokens + [9])
        restore_into(cache, slots, hit)
        assert torch.equal(slots.kv.read(1, 0, len(tokens)), slots.snapshot(0, len(tokens)))


def test_incremental_repark_moves_at_most_two_blocks_and_the_tail():
    cache, slots = make_cache(), FakeSlots()
    tokens = conversation(7, 20 * BLOCK + 9)
    first = park_tokens(cache, slots, tokens)
    grown = conversation(8, len(tokens) + BLOCK - 2, tokens)  # one more turn, shorter than a block
    second = park_tokens(cache, slots, grown)
    tail = len(grown) % BLOCK
    assert second.parked and second.conversation_id == first.conversation_id
    assert second.new_bytes <= 2 * BLOCK_BYTES + tail * BPT
    assert cache.stats().entries_ram == 1  # the shorter version was superseded
    hit = cache.lookup(grown + [1])
    assert hit.n_tokens == len(grown)
    restore_into(cache, slots, hit)
    assert torch.equal(slots.kv.read(1, 0, len(grown)), slots.snapshot(0, len(grown)))
    # parking the very same tokens again captures nothing
    assert park_tokens(cache, slots, grown).new_bytes == 0


def test_lru_eviction_frees_only_unshared_blocks():
    conv_bytes = 20 * BLOCK_BYTES
    cache, slots = make_cache(ram_bytes=int(2.5 * conv_bytes)), FakeSlots()
    system = conversation(9, 10 * BLOCK)
    a = conversation(10, 20 * BLOCK, system)
    b = conversation(11, 20 * BLOCK, system)
    c = conversation(12, 20 * BLOCK)
    park_tokens(cache, slots, a)
    park_tokens(cache, slots, b)
    assert cache.stats().blocks_ram == 30
    result = park_tokens(cache, slots, c)
    assert result.parked and result.evicted == 1
    assert len(cache.conversations()) == 2
    st = cache.stats()
    assert (
        st.blocks_ram == 30 - 10 + 20 and st.evictions == 1
    )  # A lost its 10 own blocks; the shared 10 stayed
    assert cache.lookup(a + [1]).n_tokens == len(system)  # A is gone, its prefix still offered by B
    slots.fill(0, b)
    hit = cache.lookup(b + [1])
    assert hit.n_tokens == len(b)
    restore_into(cache, slots, hit)
    assert torch.equal(slots.kv.read(1, 0, len(b)), slots.snapshot(0, len(b)))
    assert st.bytes_ram <= 2.5 * conv_bytes


def test_snapshot_larger_than_budget_is_refused_and_survivors_stay():
    cache, slots = make_cache(ram_bytes=30 * BLOCK_BYTES), FakeSlots()
    small = conversation(13, 10 * BLOCK)
    park_tokens(cache, slots, small)
    before = cache.conversations()
    result = park_tokens(cache, slots, conversation(14, 40 * BLOCK))
    assert not result.parked and result.reason == "larger_than_budget"
    assert cache.conversations() == before
    assert cache.stats().refusals == {"larger_than_budget": 1}
    assert cache.lookup(small + [1]).n_tokens == len(small)


def test_budget_is_a_hard_ceiling():
    budget = 50 * BLOCK_BYTES
    cache, slots = make_cache(ram_bytes=budget), FakeSlots()
    for i in range(12):
        assert park_tokens(cache, slots, conversation(100 + i, 13 * BLOCK + i)).parked
        assert cache.stats().bytes_ram <= budget
    assert cache.stats().evictions > 0


def test_slots_cap_evicts_least_recently_used():
    cache, slots = make_cache(slots=3), FakeSlots()
    convs = [conversation(20 + i, 3 * BLOCK) for i in range(4)]
    for tokens in convs[:3]:
        park_tokens(cache, slots, tokens)
    restore_into(cache, slots, cache.lookup(convs[0] + [1]))  # A becomes most recently used
    park_tokens(cache, slots, convs[3])
    assert cache.stats().entries_ram == 3
    assert cache.lookup(convs[1] + [1]) is None  # B was least recently used
    assert cache.lookup(convs[0] + [1]) is not None


def test_min_free_floor_refuses_and_logs(caplog):
    cache, slots = make_cache(min_free_bytes=1 << 50), FakeSlots()
    with caplog.at_level(logging.WARNING, logger="strata.cache"):
        result = park_tokens(cache, slots, conversation(30, 4 * BLOCK))
    assert not result.parked and result.reason == "floor"
    assert "floor" in caplog.text
    assert cache.stats().entries_ram == 0 and cache.stats().bytes_ram == 0


def test_cache_off_refuses():
    cache, slots = make_cache(ram_bytes=0), FakeSlots()
    result = park_tokens(cache, slots, conversation(31, 40))
    assert not result.parked and result.reason == "off"
    assert cache.lookup(conversation(31, 40)) is None


def test_lookup_is_read_only_and_alternating_conversations_keep_hitting():
    cache, slots = make_cache(slots=2), FakeSlots()
    a, b = conversation(40, 6 * BLOCK + 3), conversation(41, 5 * BLOCK + 1)
    park_tokens(cache, slots, a)
    park_tokens(cache, slots, b)
    for _ in range(3):
        for tokens in (a, b):
            for _ in range(2):
                assert cache.lookup(tokens + [5]).n_tokens == len(tokens)
            hit = cache.lookup(tokens + [5])
            restore_into(cache, slots, hit)
            slots.fill(0, tokens)
            assert torch.equal(slots.kv.read(1, 0, len(tokens)), slots.snapshot(0, len(tokens)))
    st = cache.stats()
    assert st.hits == 6 and st.entries_ram == 2 and st.evictions == 0


def test_live_prefix_and_policy_filters():
    cache, slots = make_cache(), FakeSlots()
    tokens = conversation(50, 10 * BLOCK)
    park_tokens(cache, slots, tokens)
    request = tokens + conversation(51, 100)
    assert cache.lookup(request, live_prefix=len(tokens)) is None  # the slot already has it
    assert cache.lookup(request, live_prefix=20).n_tokens == len(tokens)
    cache.reconfigure(cache.settings.replace(n_min=len(tokens) + 1))
    assert cache.lookup(request) is None
    cache.reconfigure(cache.settings.replace(n_min=0, similarity=0.7))
    assert cache.lookup(request) is None  # 160 of 260 tokens < 70%
    assert cache.lookup(tokens + [1]) is not None
    cache.reconfigure(cache.settings.replace(similarity=0.0))
    cache.prefill_tokens_per_s = 1e12  # prefill far faster than any copy: restoring is not worth it
    assert cache.lookup(request) is None
    cache.prefill_tokens_per_s = 100.0
    assert cache.lookup(request) is not None
    assert cache.stats().declined == {"n_min": 1, "similarity": 1, "cost": 1}


def test_restore_refuses_foreign_identity_or_vanished_entry_before_touching_the_slot():
    cache, slots = make_cache(), FakeSlots()
    tokens = conversation(60, 5 * BLOCK)
    park_tokens(cache, slots, tokens)
    hit = cache.lookup(tokens + [1])
    slots.fill(1, conversation(61, 50))
    before = slots.snapshot(1, 100)
    calls: list = []
    foreign = CacheHit(
        hit.conversation_id, hit.n_tokens, hit.tier, hit.nbytes, identity({"architecture": "x"}).key
    )
    with pytest.raises(CacheRestoreError, match="another model"):
        cache.restore(foreign, slots.writer(1, calls))
    with pytest.raises(CacheRestoreError, match="no longer parked"):
        cache.restore(CacheHit("0" * 16, 10, "ram", 10 * BPT, hit.identity_key), slots.writer(1, calls))
    too_long = CacheHit(hit.conversation_id, len(tokens) + 5, "ram", 0, hit.identity_key)
    with pytest.raises(CacheRestoreError):
        cache.restore(too_long, slots.writer(1, calls))
    assert calls == [] and torch.equal(slots.snapshot(1, 100), before)
    assert cache.stats().restore_failures == 3


def test_hit_survives_the_park_that_makes_room_for_it():
    cache, slots = make_cache(slots=2), FakeSlots()
    a, b, c = (conversation(70 + i, 4 * BLOCK) for i in range(3))
    park_tokens(cache, slots, a)
    park_tokens(cache, slots, b)
    hit = cache.lookup(a + [1])  # A is the LRU entry: parking C would evict it, unless kept
    assert park_tokens(cache, slots, c, keep=hit.conversation_id).parked
    restore_into(cache, slots, hit)
    slots.fill(0, a)
    assert torch.equal(slots.kv.read(1, 0, len(a)), slots.snapshot(0, len(a)))


def test_superseded_hit_is_restored_from_its_continuation():
    cache, slots = make_cache(), FakeSlots()
    a = conversation(80, 3 * BLOCK + 2)
    park_tokens(cache, slots, a)
    hit = cache.lookup(a + [1])
    park_tokens(cache, slots, conversation(81, 5 * BLOCK, a))
    assert restore_into(cache, slots, hit).n_tokens == len(a)


def test_purge_ram_reports_counts_and_stats_and_events():
    cache, slots = make_cache(), FakeSlots()
    for i in range(3):
        park_tokens(cache, slots, conversation(90 + i, 2 * BLOCK + i))
    restore_into(cache, slots, cache.lookup(conversation(90, 2 * BLOCK) + [3]))
    cache.record_miss()
    st = cache.stats()
    total = st.bytes_ram
    assert st.parks == 3 and st.restores == 1 and st.misses == 1 and st.tokens_reused == 2 * BLOCK
    assert st.park_ms.count == 3 and st.restore_ms.last > 0
    d = st.to_dict()
    assert d["park_ms"]["p95"] >= d["park_ms"]["p50"] and d["storage"] == "ram"
    result = cache.purge("ram")
    assert result.dropped == 3 and result.bytes == total and result.skipped == []
    assert cache.stats().bytes_ram == 0 and cache.stats().blocks_ram == 0
    kinds = [e["kind"] for e in cache.events()]
    assert kinds.count("park") == 3 and kinds.count("restore") == 1 and kinds.count("purge") == 3
    with pytest.raises(ValueError):
        cache.purge("everything")


def test_ram_restore_is_one_copy_per_block():
    cache, slots = make_cache(), FakeSlots()
    tokens = conversation(95, 6 * BLOCK + 4)
    park_tokens(cache, slots, tokens)
    calls: list = []
    restore_into(cache, slots, cache.lookup(tokens + [1]), calls=calls)
    assert calls == [(i * BLOCK, BLOCK) for i in range(6)] + [(6 * BLOCK, 4)]


def test_results_render_as_json():
    import json

    cache, slots = make_cache(), FakeSlots()
    tokens = conversation(96, 2 * BLOCK)
    parked = park_tokens(cache, slots, tokens)
    hit = cache.lookup(tokens + [1])
    restored = restore_into(cache, slots, hit)
    for obj in (parked, hit, restored, cache.conversations()[0], cache.stats()):
        json.dumps(obj.to_dict())
    purge = cache.purge("all").to_dict()
    assert purge == {
        "tier": "all",
        "dropped": {"conversations": 1, "bytes": purge["dropped"]["bytes"]},
        "skipped": [],
    }
