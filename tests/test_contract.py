"""The JSON contract between the engine and the desktop: strict parsing, faithful round trips."""

from __future__ import annotations

import pytest

from engine.contract import (
    CacheConfigBody,
    ContractError,
    ConversationsBody,
    Dropped,
    Event,
    EventsBody,
    PurgeBody,
    Skipped,
    parse,
    to_json,
)

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
