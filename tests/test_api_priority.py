"""Priority, pin, name and client over HTTP: the OpenAI `metadata` object and X-Strata-* headers (bad values
are 400s that say what is expected), the attributes on /cache/conversations, and PATCH /cache/conversations/{id}
(good, 404, 400). A tiny random-weight model keeps it fast."""

from __future__ import annotations

import httpx
import openai
import pytest

from engine.contract import ConversationsBody, parse
from tests.engine_process import start_engine
from tests.model_fixtures import write_tiny_model

FILLER = "The quick brown fox jumps over the lazy dog. " * 4


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("priority")
    model = write_tiny_model(root, "llama")
    proc = start_engine("--model", model, "--ctx-size", "1024", "--conversation-cache-storage", "tiered",
                        "--conversation-cache-dir", str(root / "parked"), "--conversation-cache-mib", "64",
                        "--conversation-cache-min-free-mib", "0")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(engine):
    return openai.OpenAI(base_url=engine.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(engine):
    with httpx.Client(base_url=engine.base_url, timeout=60) as c:
        yield c


def _ask(client, text: str, **kw):
    return client.chat.completions.create(model="m", messages=[{"role": "user", "content": text}], max_tokens=2,
                                          temperature=0, **kw)


def _row(rows: dict, first_word: str):
    [row] = [r for name, r in rows.items() if name.split(" ")[0] == first_word]
    return row


def _rows(http) -> dict[str, object]:
    response = http.get("/cache/conversations")
    assert response.status_code == 200, response.text
    return {row.name: row for row in parse(ConversationsBody, response.json()).conversations}


@pytest.fixture(scope="module")
def parked(client, http):
    """Three conversations on the one slot, each parked by the next: by metadata, by headers, by neither."""
    _ask(client, "Alpha conversation about the parser and its many small bugs " + FILLER,
         metadata={"strata_priority": "high", "strata_pin": "true", "strata_client": "my-agent", "task": "x"})
    _ask(client, "Beta " + FILLER,
         metadata={"strata_priority": "high"},
         extra_headers={"X-Strata-Priority": "low", "X-Strata-Pin": "FALSE", "X-Strata-Client": "hdr-client"})
    _ask(client, "Gamma " + FILLER)
    _ask(client, "Delta " + FILLER)  # parks Gamma
    return _rows(http)


def test_metadata_and_headers_reach_the_parked_conversation(parked):
    alpha = _row(parked, "Alpha")
    assert (alpha.priority, alpha.pinned, alpha.client) == ("high", True, "my-agent")
    beta = _row(parked, "Beta")
    assert (beta.priority, beta.pinned, beta.client) == ("low", False, "hdr-client"), "a header wins over metadata"
    gamma = _row(parked, "Gamma")
    assert (gamma.priority, gamma.pinned) == ("normal", False)
    assert gamma.client.startswith("OpenAI/"), "without a client name, the User-Agent's first product token"
    assert gamma.client.endswith(" · Chat Completions"), "and the API it came through"
    assert alpha.name == "Alpha conversation about the parser and its many", "whole words, at most 48 characters"
    assert all(len(name) <= 48 for name in parked)


@pytest.mark.parametrize(
    ("kw", "param", "says"),
    [
        ({"metadata": {"strata_priority": "urgent"}}, "metadata.strata_priority",
         "expected one of high, normal, low, got 'urgent'"),
        ({"extra_headers": {"X-Strata-Priority": "urgent"}}, "x-strata-priority", "expected one of high, normal, low"),
        ({"metadata": {"strata_pin": "yes"}}, "metadata.strata_pin", "expected true or false, got 'yes'"),
        ({"extra_headers": {"X-Strata-Pin": "2"}}, "x-strata-pin", "expected true or false"),
        ({"metadata": {"strata_prio": "high"}}, "metadata.strata_prio", "unknown key"),
        ({"extra_body": {"metadata": {"strata_pin": True}}}, "metadata.strata_pin", "string"),
    ],
)
def test_bad_values_are_refused_with_what_is_expected(client, kw, param, says):
    with pytest.raises(openai.BadRequestError) as info:
        _ask(client, "Refused " + FILLER, **kw)
    error = info.value.body
    assert error["param"] == param and says in error["message"], error


def test_completions_take_metadata_too(engine, http):
    response = http.post("/v1/completions", json={"prompt": "Completion words here " + FILLER, "max_tokens": 2,
                                                  "metadata": {"strata_priority": "bogus"}})
    assert response.status_code == 400 and "strata_priority" in response.json()["error"]["message"]


def test_patch_changes_priority_and_pin_and_answers_the_rows(http, parked):
    gamma = _row(parked, "Gamma")
    response = http.patch(f"/cache/conversations/{gamma.id}", json={"priority": "high", "pinned": True})
    assert response.status_code == 200, response.text
    rows = parse(ConversationsBody, response.json()).conversations
    assert rows and all((r.id, r.priority, r.pinned) == (gamma.id, "high", True) for r in rows)
    assert _rows(http)[gamma.name].priority == "high"
    response = http.patch(f"/cache/conversations/{gamma.id}", json={"pinned": False})
    assert [(r.priority, r.pinned) for r in parse(ConversationsBody, response.json()).conversations][0] == (
        "high", False)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"priority": "urgent"}, "expected one of high, normal, low, got 'urgent'"),
        ({"pinned": "yes"}, "pinned"),
        ({"priority": "low", "colour": "red"}, "colour"),
        ({}, "expected a JSON object with \"priority\""),
    ],
)
def test_patch_refuses_bad_bodies(http, parked, body, says):
    gamma = _row(parked, "Gamma")
    response = http.patch(f"/cache/conversations/{gamma.id}", json=body)
    assert response.status_code == 400, response.text
    assert says in response.json()["error"]["message"]


def test_patch_of_an_unknown_conversation_is_404(http, parked):
    response = http.patch("/cache/conversations/0123456789abcdef", json={"priority": "low"})
    assert response.status_code == 404
    assert "is not parked" in response.json()["error"]["message"]


def test_a_conversation_keeps_its_system_prompts_first_words(client, http, parked):
    system = "You are a terse assistant that answers in one short line and never more than that, ever"
    for text in ("Eta conversation with a system prompt " + FILLER, "Theta " + FILLER):  # Theta parks Eta
        client.chat.completions.create(model="m", max_tokens=2, temperature=0, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": text}])
    eta = _row(_rows(http), "Eta")
    assert eta.system == "You are a terse assistant that answers in one", "whole words, at most 48 characters"
    assert _row(_rows(http), "Alpha").system == "", "no system message: no system words"


def test_delete_drops_one_conversation_and_leaves_the_others(client, http, parked):
    _ask(client, "Epsilon conversation to be dropped from its row " + FILLER)
    _ask(client, "Zeta " + FILLER)  # parks Epsilon
    before = _rows(http)
    epsilon = _row(before, "Epsilon")
    response = http.delete(f"/cache/conversations/{epsilon.id}")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["dropped"]["conversations"] == 1 and body["dropped"]["bytes"] > 0 and body["skipped"] == []
    after = _rows(http)
    assert all(row.id != epsilon.id for row in after.values()), "the dropped conversation is gone"
    assert {r.id for r in before.values()} - {epsilon.id} <= {r.id for r in after.values()}, "the others stay"
    again = http.delete(f"/cache/conversations/{epsilon.id}")
    assert again.status_code == 404 and "is not parked" in again.json()["error"]["message"]
    reply = _ask(client, "Epsilon conversation to be dropped from its row " + FILLER)
    cached = reply.usage.prompt_tokens_details.cached_tokens if reply.usage.prompt_tokens_details else 0
    assert cached < reply.usage.prompt_tokens // 2, "nothing of the dropped conversation is restored"
