"""Every request explained, on a live engine through the openai SDK: GET /cache/requests says how much of each
prompt was reused, from where, and why the rest was computed (new tokens, a divergence at token k, an eviction,
the floor, n_min, similarity), and /metrics counts each reason. A tiny random-weight model keeps it fast; the
prompts are token ids so the test knows exactly where they share and where they part.
"""

from __future__ import annotations

import random

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.contract import RequestRecord, RequestsBody, parse
from tests.engine_process import start_engine
from tests.model_fixtures import tiny_vocab_size, write_tiny_model

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("explain")
    model = write_tiny_model(root, "llama")
    proc = start_engine("--model", model, "--ctx-size", "512", "--conversation-cache-dir", str(root / "parked"),
                        "--conversation-cache-mib", "64", "--conversation-cache-min-free-mib", "0")
    proc.model = model
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def http(engine):
    with httpx.Client(base_url=engine.base_url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def sdk(engine):
    return openai.OpenAI(base_url=engine.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def fresh(http):
    """Nothing parked, default cache settings, and back to them afterwards."""
    defaults = {"conversation_cache_storage": "ram", "conversation_cache_mib": 64, "conversation_cache_n_min": 0,
                "conversation_cache_similarity": 0.0, "conversation_cache_min_free_mib": 0}
    assert http.put("/cache/config", json=defaults).status_code == 200
    assert http.post("/cache/purge", json={"tier": "all"}).status_code == 200
    yield
    assert http.put("/cache/config", json=defaults).status_code == 200


_seeds = iter(range(1, 10_000))


def tokens(n: int) -> list[int]:
    """`n` token ids no other call of this module starts with (ids 0-2 are special)."""
    rng = random.Random(next(_seeds))
    vocab = tiny_vocab_size()
    return [rng.randrange(3, vocab) for _ in range(n)]


def ask(sdk, prompt: list[int]) -> str:
    """One completion of a single token (the slot then holds exactly the prompt); returns the request id."""
    return sdk.completions.create(model="m", prompt=prompt, max_tokens=1, temperature=0).id


def records(http, limit: int | None = None) -> list[RequestRecord]:
    r = http.get("/cache/requests", params={} if limit is None else {"limit": limit})
    assert r.status_code == 200, r.text
    return parse(RequestsBody, r.json(), "GET /cache/requests").requests


def record(http, request_id: str) -> RequestRecord:
    found = [r for r in records(http) if r.request_id == request_id]
    assert len(found) == 1, f"{request_id} is logged once"
    return found[0]


def set_live(http, **settings) -> None:
    r = http.put("/cache/config", json=settings)
    assert r.status_code == 200, r.text


def test_cold_then_new_tokens_from_the_live_slot_then_a_ram_hit(http, sdk, fresh):
    a = tokens(120)
    cold = record(http, ask(sdk, a))
    assert (cold.source, cold.reason, cold.reused_tokens, cold.prompt_tokens) == ("none", "cold", 0, 120)
    assert cold.ttft_ms is not None and cold.ttft_ms > 0
    assert cold.priority == "normal" and cold.conversation_id is None

    grown = a + tokens(30)
    live = record(http, ask(sdk, grown))
    assert (live.source, live.reason, live.reused_tokens) == ("live", "new_tokens", 120)
    assert live.detail["computed"] == 30

    ask(sdk, tokens(100))  # another conversation takes the slot: the first one is parked
    parked = http.get("/cache/conversations").json()["conversations"]
    line = next(c["id"] for c in parked if c["tokens"] == len(grown))
    assert record(http, live.request_id).conversation_id == line, "its park named the requests it served"
    assert record(http, cold.request_id).conversation_id == line

    back = record(http, ask(sdk, grown + tokens(10)))
    assert (back.source, back.reason, back.reused_tokens) == ("ram", "new_tokens", len(grown))
    assert back.conversation_id == line


def test_a_prompt_that_leaves_its_conversation_says_where_and_shows_the_text(http, sdk, engine, fresh):
    from tokenizers import Tokenizer

    a = tokens(90)
    ask(sdk, a)
    edited = a[:57] + [t + 1 if t + 1 < tiny_vocab_size() else 3 for t in a[57:]]  # differs from token 57 on
    rec = record(http, ask(sdk, edited))
    assert (rec.source, rec.reason, rec.reused_tokens) == ("live", "diverged", 57)
    d = rec.detail
    assert d["diverged_at"] == 57 and d["candidate"] == "slot 0" and d["candidate_tokens"] == 90
    tok = Tokenizer.from_file(f"{engine.model}/tokenizer.json")
    assert d["before"] == tok.decode(a[51:57])
    assert d["prompt_after"] == tok.decode(edited[57:63])
    assert d["candidate_after"] == tok.decode(a[57:63])
    assert d["prompt_after"] != d["candidate_after"]

    # The same from a parked conversation: restored up to where the prompt leaves it.
    ask(sdk, tokens(80))  # parks `edited`
    branch = edited[:70] + [3] * 10
    rec = record(http, ask(sdk, branch))
    assert (rec.source, rec.reason, rec.reused_tokens) == ("ram", "diverged", 70)
    assert rec.detail["diverged_at"] == 70 and rec.detail["candidate"].startswith("conversation ")


def test_a_conversation_evicted_by_the_ram_budget_says_by_what_and_when(http, sdk, fresh):
    # 480 tokens of the tiny model's K/V are ~0.35 MiB: two fit in 1 MiB, a third evicts the oldest.
    set_live(http, conversation_cache_mib=1)
    a, b, c, d = (tokens(480) for _ in range(4))
    for prompt in (a, b, c):
        ask(sdk, prompt)
    ask(sdk, d)  # parks c, which evicts a
    rows = http.get("/cache/conversations").json()["conversations"]
    c_id = next(r["id"] for r in rows if r["tokens"] == len(c))
    assert len(rows) == 2
    rec = record(http, ask(sdk, a))
    assert (rec.source, rec.reason, rec.reused_tokens) == ("none", "evicted", 0)
    det = rec.detail
    assert det["kind"] == "evict" and det["tier"] == "ram" and det["budget"] == "conversation-cache-mib"
    assert det["by"] == "park" and det["by_conversation"] == c_id
    assert det["matched"] == len(a) - 1 and det["lost_tokens"] == len(a)
    assert det["when"] <= rec.time


def test_a_park_refused_by_the_floor_is_the_reason(http, sdk, fresh):
    set_live(http, conversation_cache_min_free_mib=1 << 24)  # 16 TiB must stay free: no RAM park fits
    a = tokens(100)
    ask(sdk, a)
    ask(sdk, tokens(100))  # the park of `a` is refused
    rec = record(http, ask(sdk, a + tokens(5)))
    assert (rec.source, rec.reason) == ("none", "floor")
    assert rec.detail["refusal"] == "floor" and rec.detail["matched"] == len(a)


def test_hits_declined_by_n_min_and_similarity_say_so(http, sdk, fresh):
    set_live(http, conversation_cache_n_min=10_000)
    a = tokens(100)
    ask(sdk, a)
    ask(sdk, tokens(100))
    rec = record(http, ask(sdk, a + tokens(3)))
    assert (rec.source, rec.reason, rec.reused_tokens) == ("none", "n_min", 0)
    assert rec.detail["n_min"] == 10_000 and rec.detail["offered"] == len(a) and rec.detail["tier"] == "ram"
    assert rec.detail["predicted_restore_s"] > 0 and rec.detail["predicted_prefill_s"] > 0

    set_live(http, conversation_cache_n_min=0, conversation_cache_similarity=0.9)
    b = tokens(60)
    ask(sdk, b)
    ask(sdk, tokens(60))
    rec = record(http, ask(sdk, b + tokens(200)))  # the hit covers 60 of 260 tokens
    assert (rec.source, rec.reason) == ("none", "similarity")
    assert rec.detail["similarity"] == 0.9 and rec.detail["offered"] == len(b)


def test_a_disk_hit(http, sdk, fresh):
    set_live(http, conversation_cache_storage="disk")
    a = tokens(130)
    ask(sdk, a)
    ask(sdk, tokens(70))  # parks `a` on disk
    rec = record(http, ask(sdk, a + tokens(4)))
    assert (rec.source, rec.reason, rec.reused_tokens) == ("disk", "new_tokens", len(a))


def test_reasons_are_counted_in_metrics_and_prometheus(http, sdk, fresh):
    ask(sdk, tokens(40))
    counts = http.get("/metrics").json()["engine"]["prefill_reasons"]
    assert counts["cold"] >= 1 and set(counts) >= {"new_tokens", "diverged", "evicted", "floor", "n_min"}
    text = http.get("/metrics", params={"format": "prometheus"}).text
    samples = {(s.name, s.labels.get("reason")): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("strata_prefill_reason_total", "cold")] == counts["cold"]
    assert samples[("strata_prefill_reason_total", "evicted")] == counts["evicted"]
    assert not any(name.startswith("strata_engine_prefill_reasons") for name, _ in samples)


def test_requests_route_limits_and_refuses_bad_limits(http, sdk):
    ids = [ask(sdk, tokens(20)) for _ in range(3)]
    last_two = records(http, limit=2)
    assert [r.request_id for r in last_two] == ids[1:], "newest last"
    for bad in ("0", "1001", "x", "-1"):
        r = http.get("/cache/requests", params={"limit": bad})
        assert r.status_code == 400 and "limit" in r.json()["error"]["message"]
