"""The operator routes on a live engine with the conversation cache on: /slots save|restore|erase, /cache/*,
/metrics with a cache section, and POST /shutdown. A tiny random-weight model keeps it fast."""

from __future__ import annotations

import json
import os

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.engine_process import start_engine
from tests.model_fixtures import write_tiny_model

FILLER = "The quick brown fox jumps over the lazy dog. " * 8


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("control")
    model = write_tiny_model(root, "llama")
    proc = start_engine("--model", model, "--ctx-size", "512", "--slot-save-path", str(root / "slots"),
                        "--conversation-cache-dir", str(root / "parked"), "--conversation-cache-mib", "64",
                        "--conversation-cache-min-free-mib", "0")
    proc.save_dir = root / "slots"
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def http(engine):
    with httpx.Client(base_url=engine.base_url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def alternated(engine) -> list:
    """Conversations A, B, A on one slot: B parks A, the second A restores it."""
    client = openai.OpenAI(base_url=engine.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def ask(text: str):
        return client.chat.completions.create(model="m", messages=[{"role": "user", "content": text}],
                                              max_tokens=3, temperature=0).usage

    return [ask("A: " + FILLER), ask("B: Hello, world! " + FILLER), ask("A: " + FILLER)]


def ok(response: httpx.Response):
    assert response.status_code == 200, response.text
    return response.json()


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_returning_conversation_reports_cached_tokens(alternated):
    first_a, _, second_a = alternated
    assert second_a.prompt_tokens == first_a.prompt_tokens
    assert second_a.prompt_tokens_details.cached_tokens >= first_a.prompt_tokens // 2


def test_metrics_json_has_engine_and_cache_sections(http, alternated):
    body = http.get("/metrics").json()
    assert body["engine"]["requests"] >= 3
    cache = body["conversation_cache"]
    assert cache["enabled"] is True and cache["storage"] == "ram"
    assert cache["parks"] >= 1 and cache["restores"] >= 1


def test_metrics_prometheus_includes_the_cache(http, alternated):
    text = http.get("/metrics", params={"format": "prometheus"}).text
    samples = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["strata_conversation_cache_parks_total"].value >= 1
    assert samples["strata_conversation_cache_info"].labels["storage"] == "ram"


def test_cache_conversations_and_events(http, alternated):
    conversations = ok(http.get("/cache/conversations"))["conversations"]
    assert conversations
    for entry in conversations:
        assert {"id", "tokens", "bytes", "tier", "created", "last_used", "hits"} <= set(entry)
    events = ok(http.get("/cache/events", params={"limit": 2}))["events"]
    assert 1 <= len(events) <= 2


def test_every_body_the_desktop_reads_has_the_contract_shape(http, alternated):
    from engine.contract import (
        CacheConfigBody,
        ConversationsBody,
        EventsBody,
        MetricsBody,
        parse,
        to_json,
    )

    for cls, path in ((MetricsBody, "/metrics"), (ConversationsBody, "/cache/conversations"),
                      (EventsBody, "/cache/events"), (CacheConfigBody, "/cache/config")):
        data = ok(http.get(path))
        assert to_json(parse(cls, data)) == data, f"{path} round-trips through its contract type unchanged"
    assert parse(ConversationsBody, ok(http.get("/cache/conversations"))).conversations
    answer = parse(CacheConfigBody, ok(http.put("/cache/config", json={"conversation_cache_slots": "32"})))
    assert answer.settings["conversation_cache_slots"] == 32 and answer.changed == ["conversation_cache_slots"]
    ok(http.put("/cache/config", json={"conversation_cache_slots": 64}))


def test_cache_config_reads_and_changes_live_settings(http):
    config = http.get("/cache/config").json()
    assert "conversation_cache_mib" in config["live"]
    assert config["settings"]["conversation_cache_mib"] == 64
    changed = http.put("/cache/config", json={"conversation_cache_mib": 48}).json()
    assert changed["changed"] == ["conversation_cache_mib"]
    back = http.put("/cache/config", json={"settings": {"conversation_cache_mib": 64}}).json()
    assert back["settings"]["conversation_cache_mib"] == 64
    assert "ctx_size" in error_of(http.put("/cache/config", json={"ctx_size": 64}), 400)["message"]


def test_slot_save_erase_restore_round_trip(http, engine, alternated):
    [slot] = http.get("/slots").json()
    saved = http.post("/slots/0", params={"action": "save"}, json={"filename": "a.slot"})
    assert saved.status_code == 200, saved.text
    assert saved.json()["n_saved"] == slot["n_tokens"] > 0
    assert os.path.isfile(engine.save_dir / "a.slot")
    assert http.post("/slots/0", params={"action": "erase"}).json()["n_erased"] == slot["n_tokens"]
    assert http.get("/slots").json()[0]["n_tokens"] == 0
    restored = http.post("/slots/0", params={"action": "restore"}, json={"filename": "a.slot"}).json()
    assert restored["n_restored"] == slot["n_tokens"]
    assert http.get("/slots").json()[0]["n_tokens"] == slot["n_tokens"]


def test_slot_file_names_outside_the_save_path_are_refused(http, engine):
    for name in ("../escape.slot", "/tmp/abs.slot", ""):
        error_of(http.post("/slots/0", params={"action": "save"}, json={"filename": name}), 400)
    assert not os.path.exists(engine.save_dir.parent / "escape.slot")
    error_of(http.post("/slots/0", params={"action": "restore"}, json={"filename": "missing.slot"}), 404)
    error_of(http.post("/slots/0", params={"action": "save"}, json={}), 400)


def test_a_folder_named_as_a_slot_file_is_refused_as_a_folder(http, engine, alternated):
    """Not "Permission denied", which Windows says when a folder is opened as a file."""
    os.makedirs(engine.save_dir / "kept.slot", exist_ok=True)
    for action in ("save", "restore"):
        err = error_of(http.post("/slots/0", params={"action": action}, json={"filename": "kept.slot"}), 400)
        assert "'kept.slot' is a folder, expected a file" in err["message"], err
        assert str(engine.save_dir) not in err["message"]
    assert os.listdir(engine.save_dir / "kept.slot") == []


JSON = {"Content-Type": "application/json"}


@pytest.mark.parametrize("method, path", [
    ("PUT", "/cache/config"), ("POST", "/cache/purge"), ("POST", "/slots/0?action=save"),
    ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
])
def test_json_nested_ten_thousand_deep_is_a_400(http, method, path):
    for body in ("[" * 10000 + "]" * 10000, '{"a":' * 10000 + "1" + "}" * 10000):
        err = error_of(http.request(method, path, content=body.encode(), headers=JSON), 400)
        assert "JSON" in err["message"] or "nest" in err["message"]


@pytest.mark.parametrize("size", [230, 231, 237, 250, 255])
def test_long_slot_file_names_are_saved_or_refused_clearly(http, engine, alternated, size):
    name = "n" * (size - 5) + ".slot"
    r = http.post("/slots/0", params={"action": "save"}, json={"filename": name})
    if size <= 230:  # the longest name whose temporary name still fits in 255 bytes
        assert r.status_code == 200, r.text
        assert os.path.isfile(engine.save_dir / name)
        return
    err = error_of(r, 400)
    assert "at most 230 bytes" in err["message"] and f"got {size}" in err["message"]
    assert str(engine.save_dir) not in r.text


@pytest.mark.parametrize("name", ["con", "NUL", "COM1", "lpt1.slot", "aux.tar.gz", "prn", "Con .x", "name."])
def test_windows_device_names_are_refused_as_slot_files(http, engine, alternated, name):
    err = error_of(http.post("/slots/0", params={"action": "save"}, json={"filename": name}), 400)
    assert "Windows" in err["message"] or "dot" in err["message"]
    assert not os.path.exists(engine.save_dir / name)


def test_a_slot_file_name_with_half_a_surrogate_pair_is_refused_naming_that(http):
    # The JSON body's parser refuses such an escape first (errors.py); a name from elsewhere meets this check.
    body = b'{"filename": "a\\ud800b.slot"}'
    r = http.post("/slots/0", params={"action": "save"}, content=body, headers={"Content-Type": "application/json"})
    assert "half of a UTF-16 surrogate pair" in error_of(r, 400)["message"]
    from engine.errors import ApiError
    from engine.server.slot_names import check_slot_file_name

    with pytest.raises(ApiError, match="half of a UTF-16 surrogate pair"):
        check_slot_file_name("a\ud800b.slot")


@pytest.mark.parametrize("slot_id", ["\u00b2", "\uff11", "\u0660", "1" * 5000, "-1", "0x1"])
def test_slot_ids_are_ascii_digits_only(http, slot_id):
    err = error_of(http.post(f"/slots/{slot_id}", params={"action": "erase"}), 400)
    assert "digits 0-9" in err["message"]
    err = error_of(http.get("/cache/events", params={"limit": slot_id}), 400)
    assert "limit" in err["message"]


def test_purge_reports_what_it_dropped(http, alternated):
    from engine.contract import PurgeBody, parse

    result = ok(http.post("/cache/purge", json={"tier": "all"}))
    assert parse(PurgeBody, result).tier == "all"
    assert result["tier"] == "all"
    assert result["dropped"]["conversations"] >= 1
    assert ok(http.get("/cache/conversations"))["conversations"] == []
    # the cache emptied: a budget of 0 turns it off, and GET /cache/config says so as /metrics does
    http.put("/cache/config", json={"conversation_cache_mib": 0})
    assert http.get("/cache/config").json()["enabled"] is False
    http.put("/cache/config", json={"conversation_cache_mib": 64})
    assert http.get("/cache/config").json()["enabled"] is True


def test_head_health_is_get_without_the_body(http):
    get, head = http.get("/health"), http.head("/health")
    assert (head.status_code, head.content) == (get.status_code, b"") == (200, b"")
    assert head.headers["content-type"] == get.headers["content-type"] == "application/json"


PROMPT = "Caf\u00e9 \u2603 \U0001d11e: " + FILLER  # Latin-1, BMP and astral characters


@pytest.mark.parametrize("charset, codec, bom", [
    ("utf-8", "utf-8", b""), (None, "utf-8", b"\xef\xbb\xbf"), ("utf-16", "utf-16", b""),
    ("UTF-16LE", "utf-16-le", b""), ('"utf-16be"', "utf-16-be", b""), (None, "utf-16-le", b"\xff\xfe"),
    ("utf-32", "utf-32", b""), ("utf-32be", "utf-32-be", b""), (None, "utf-32-be", b"\x00\x00\xfe\xff"),
    ("utf-16", "utf-16-be", b""),  # unmarked: the zero bytes around the first character show the byte order
    (None, "utf-16-le", b""), (None, "utf-32-le", b""),
])
def test_bodies_are_decoded_by_their_charset_or_byte_order_mark(http, charset, codec, bom):
    body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "echo": True}
    expected = ok(http.post("/v1/completions", json=body))
    raw = bom + json.dumps(body, ensure_ascii=False).encode(codec)
    content_type = "application/json" + (f"; charset={charset}" if charset else "")
    answer = ok(http.post("/v1/completions", content=raw, headers={"Content-Type": content_type}))
    assert answer["choices"][0]["text"] == expected["choices"][0]["text"]
    assert answer["choices"][0]["text"].startswith(PROMPT)  # echoed: every character arrived whole
    assert answer["usage"]["prompt_tokens"] == expected["usage"]["prompt_tokens"]


def test_a_charset_json_cannot_use_is_refused_naming_it(http):
    raw = json.dumps({"prompt": "Caf\u00e9", "max_tokens": 1}, ensure_ascii=False).encode("latin-1")
    err = error_of(http.post("/v1/completions", content=raw,
                             headers={"Content-Type": "application/json; charset=ISO-8859-1"}), 415)
    assert "ISO-8859-1" in err["message"] and "UTF-8" in err["message"] and err["param"] == "Content-Type"
    # A byte order mark that contradicts the declared charset is a 400 naming both.
    raw = b"\xff\xfe" + '{"prompt": "x"}'.encode("utf-16-le")
    err = error_of(http.post("/v1/completions", content=raw,
                             headers={"Content-Type": "application/json; charset=utf-32"}), 400)
    assert "UTF-16" in err["message"] and "utf-32" in err["message"]
    odd = '{"prompt": "x"}'.encode("utf-16-le")[:-1]  # a byte short of whole UTF-16 code units
    err = error_of(http.post("/v1/completions", content=odd,
                             headers={"Content-Type": "application/json; charset=utf-16le"}), 400)
    assert "not valid UTF-16LE" in err["message"]


def test_openapi_declares_the_prometheus_text_that_metrics_serves(http):
    doc = ok(http.get("/openapi.json"))
    content = doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert set(content) == {"application/json", "text/plain; version=0.0.4"}
    served = http.get("/metrics", params={"format": "prometheus"}).headers["content-type"]
    assert served.split(";")[:2] == "text/plain; version=0.0.4".split(";"), served
    assert ok(http.get("/metrics"))  # and JSON by default


def test_shutdown_stops_the_engine_cleanly(http, engine):
    r = http.post("/shutdown")
    assert (r.status_code, r.json()) == (202, {"status": "shutting down"})
    assert engine.proc.wait(timeout=60) == 0
    assert "Traceback" not in engine.logs()
