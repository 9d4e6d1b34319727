"""What a lookup reports for a request's explanation: the cost model's two predicted times when it declines a
hit, the slot budget behind an eviction, a tiered spill that is not a loss, and the bounded record of losses.
Real caches over real K/V buffers (tests/test_cache_support.py)."""

from __future__ import annotations

from engine.cache.explain import MAX_LOSSES
from engine.runtime.explain import Admission, explain
from tests.test_cache_support import BLOCK, FakeSlots, conversation, make_cache, park_tokens


def test_a_hit_declined_by_the_cost_model_reports_both_predicted_times():
    cache, slots = make_cache(), FakeSlots()
    tokens = conversation(1, 6 * BLOCK)
    assert park_tokens(cache, slots, tokens).parked
    cache.prefill_tokens_per_s = 1e12  # prefilling is (said to be) far faster than any read
    request = tokens + [5, 6]
    hit, report = cache.explain_lookup(request)
    assert hit is None and report.verdict == "cost"
    d = report.verdict_detail
    assert d["predicted_prefill_s"] == len(tokens) / 1e12
    assert d["predicted_restore_s"] >= d["predicted_prefill_s"] and d["offered"] == len(tokens)
    reason, detail = explain(Admission(request, 0, "none", None, report), decode=str)
    assert reason == "cost" and detail["predicted_restore_s"] == d["predicted_restore_s"]
    assert cache.stats().declined == {"cost": 1}

    cache.prefill_tokens_per_s = 1.0  # now restoring wins: the same lookup is a hit, with its times
    hit, report = cache.explain_lookup(request)
    assert hit is not None and report.verdict == ""
    assert report.verdict_detail["predicted_restore_s"] < report.verdict_detail["predicted_prefill_s"]


def test_an_eviction_for_the_slot_count_names_that_budget_and_the_conversation_that_took_the_room():
    cache, slots = make_cache(slots=1), FakeSlots()
    a, b = conversation(2, 3 * BLOCK), conversation(3, 3 * BLOCK)
    park_tokens(cache, slots, a)
    b_id = park_tokens(cache, slots, b).conversation_id
    hit, report = cache.explain_lookup(a + [1])
    assert hit is None and report.conversation_id is None, "b shares nothing with a: no candidate"
    assert report.loss_kind == "evict"
    assert report.loss["budget"] == "conversation-cache-slots" and report.loss["by_conversation"] == b_id
    assert report.loss["matched"] == len(a)


def test_a_conversation_spilled_to_disk_is_a_hit_not_a_loss(tmp_path):
    cache, slots = make_cache(storage="tiered", dir=str(tmp_path), slots=1), FakeSlots()
    a, b = conversation(4, 3 * BLOCK), conversation(5, 3 * BLOCK)
    park_tokens(cache, slots, a)
    park_tokens(cache, slots, b)  # RAM holds one: a spills to disk
    assert cache.flush()
    hit, report = cache.explain_lookup(a + [1])
    assert hit is not None and hit.tier == "disk" and report.loss is None
    cache.close(spill=False)


def test_the_record_of_losses_is_bounded_and_the_newest_are_kept():
    cache, slots = make_cache(slots=1), FakeSlots()
    convs = [conversation(100 + i, BLOCK + 1) for i in range(MAX_LOSSES + 3)]
    for tokens in convs:
        park_tokens(cache, slots, tokens)
    losses = cache.journal.losses.records
    assert len(losses) == MAX_LOSSES
    assert cache.explain_lookup(convs[0] + [1])[1].loss is None, "the oldest loss is forgotten"
    assert cache.explain_lookup(convs[-2] + [1])[1].loss_kind == "evict"


def test_the_record_of_losses_holds_a_bounded_number_of_tokens():
    cache, slots = make_cache(slots=1), FakeSlots()
    cache.journal.losses.max_tokens = 5 * BLOCK
    convs = [conversation(400 + i, 2 * BLOCK) for i in range(5)]
    for tokens in convs:
        park_tokens(cache, slots, tokens)
    kept = cache.journal.losses.records
    assert sum(len(r.tokens) for r in kept) <= 5 * BLOCK and len(kept) == 2
    assert cache.explain_lookup(convs[-2] + [1])[1].loss is not None
    assert cache.explain_lookup(convs[0] + [1])[1].loss is None
