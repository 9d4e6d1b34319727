"""The JSON contract between the engine and the desktop: strict parsing, faithful round trips."""

from __future__ import annotations

import re

import pytest

from engine.contract import (
    CacheConfigBody,
    ContractError,
    ConversationsBody,
    Dropped,
    Event,
    EventsBody,
    MetricsBody,
    PurgeBody,
    Skipped,
    parse,
    to_json,
)
from engine.figures import CacheFigures, EngineFigures, Timing, counter_names

CONFIG = {"settings": {"conversation_cache_mib": 64}, "live": ["conversation_cache_mib"],
          "effective_dir": "/tmp/c", "enabled": True}


def test_a_body_round_trips_and_optional_parts_are_left_out():
    assert to_json(parse(CacheConfigBody, CONFIG)) == CONFIG, "no 'changed': null added to GET's answer"
    put = {**CONFIG, "changed": ["conversation_cache_mib"]}
    assert parse(CacheConfigBody, put).changed == ["conversation_cache_mib"]
    purge = to_json(PurgeBody("all", Dropped(2, 10), [Skipped("c1", "in use")]))
    assert purge == {"tier": "all", "dropped": {"conversations": 2, "bytes": 10},
                     "skipped": [{"id": "c1", "reason": "in use"}]}


def test_an_event_keeps_the_fields_its_kind_adds_at_the_top_level():
    raw = {"time": 1.0, "kind": "refuse", "conversation_id": None, "tokens": 3, "bytes": 0, "ms": 0.5,
           "tier": "ram", "reason": "budget"}
    body = parse(EventsBody, {"events": [raw]})
    assert body.events[0] == Event(1.0, "refuse", None, 3, 0, 0.5, "ram", {"reason": "budget"})
    assert to_json(body) == {"events": [raw]}


@pytest.mark.parametrize(("data", "words"), [
    ([], "CacheConfigBody: expected a JSON object, got list"),
    ({k: v for k, v in CONFIG.items() if k != "live"}, "missing field 'live'"),
    ({**CONFIG, "enabled": "yes"}, "CacheConfigBody.enabled: expected true or false, got str"),
    ({**CONFIG, "live": "conversation_cache_mib"}, "CacheConfigBody.live: expected a list, got str"),
    ({**CONFIG, "budgets": {}}, "unexpected field 'budgets'"),
])
def test_an_unknown_shape_is_refused_naming_the_field(data, words):
    with pytest.raises(ContractError) as info:
        parse(CacheConfigBody, data)
    assert words in str(info.value)


def test_a_nested_row_of_the_wrong_type_names_its_place():
    row = {"id": "a", "tokens": "12", "bytes": 1, "tier": "ram", "created": 1.0, "last_used": 2, "hits": 0}
    with pytest.raises(ContractError, match=r"conversations\[0\]\.tokens: expected a whole number, got str"):
        parse(ConversationsBody, {"conversations": [row]})
    with pytest.raises(ContractError, match="expected a whole number, got bool"):
        parse(ConversationsBody, {"conversations": [{**row, "tokens": True}]})
    assert parse(ConversationsBody, {"conversations": [{**row, "tokens": 12}]}).conversations[0].last_used == 2.0


def test_metrics_figures_are_typed_and_parsed_strictly():
    engine = {"model": "m", "state": "ok", "requests": 3, "prefill_tokens_per_s": 12.5, "devices": ["cpu"]}
    cache = {"enabled": True, "storage": "tiered", "hits": 2, "park_ms": {"last": 1.0, "p50": 1.0, "p95": 2.0,
                                                                          "count": 4},
             "refusals": {"min_free": 1}, "restore_bandwidth": {"ram": 1e9}}
    body = parse(MetricsBody, {"engine": engine, "conversation_cache": cache})
    assert isinstance(body.engine, EngineFigures) and body.engine.requests == 3 and body.engine.slots == 0
    assert body.conversation_cache.park_ms == Timing(1.0, 1.0, 2.0, 4) and body.conversation_cache.misses == 0
    again = to_json(body)  # the same JSON object, by field name, every figure present
    assert again["engine"]["requests"] == 3 and again["conversation_cache"]["refusals"] == {"min_free": 1}
    assert parse(MetricsBody, again) == body
    for where, bad, words in [
        ("engine", {**engine, "expert_bytes": 1}, "MetricsBody.engine: unexpected field 'expert_bytes'"),
        ("engine", {**engine, "requests": 2.5}, "MetricsBody.engine.requests: expected a whole number, got float"),
        ("conversation_cache", {**cache, "park_ms": {"p50": "1"}}, "park_ms.p50: expected a number, got str"),
        ("conversation_cache", {k: v for k, v in cache.items() if k != "storage"}, "missing field 'storage'"),
    ]:
        data = {"engine": engine, "conversation_cache": cache, where: bad}
        with pytest.raises(ContractError, match=re.escape(words)):
            parse(MetricsBody, data)


def test_the_totals_the_caches_journal_counts_are_the_declared_counters():
    from engine.cache.journal import COUNTERS

    assert counter_names(CacheFigures) == COUNTERS and "restore_failures" in COUNTERS
    assert counter_names(EngineFigures) == ("requests", "prompt_tokens", "cached_tokens", "generated_tokens",
                                            "restores_without_reuse", "spec_drafted_tokens", "spec_accepted_tokens")
