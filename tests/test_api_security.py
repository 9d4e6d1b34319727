"""Issue 19.3's probes against a real engine: what a web page can make a browser send (simple cross-site
requests, DNS rebinding) is refused, and what the desktop app and the openai SDK send still works."""

from __future__ import annotations

import os

import httpx
import openai
import pytest

from tests.engine_process import start_engine
from tests.model_fixtures import write_tiny_model

EVIL = {"Origin": "https://evil.example"}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("security")
    model = write_tiny_model(root, "llama")
    proc = start_engine("--model", model, "--ctx-size", "256", "--slot-save-path", str(root / "slots"),
                        "--conversation-cache-dir", str(root / "parked"), "--conversation-cache-mib", "64",
                        "--conversation-cache-min-free-mib", "0")
    proc.root = root
    client = openai.OpenAI(base_url=proc.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
    for text in ("first conversation " * 8, "second conversation " * 8):  # the first is parked
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": text}], max_tokens=2)
    yield proc
    proc.stop()


def parked(engine) -> int:
    return len(httpx.get(engine.base_url + "/cache/conversations", timeout=30).json()["conversations"])


def test_simple_cross_site_requests_are_refused_and_change_nothing(engine):
    url = engine.base_url
    before = parked(engine)
    assert before >= 1
    r = httpx.post(url + "/v1/chat/completions", headers={**EVIL, "Content-Type": "text/plain"}, timeout=30,
                   content=b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}')
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    r = httpx.post(url + "/v1/completions", data={"prompt": "hi"}, timeout=30)  # a form, no Origin
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
    assert httpx.post(url + "/slots/0?action=save", headers=EVIL, data={"filename": "x"}, timeout=30).status_code \
        == 403
    assert not os.path.exists(engine.root / "slots" / "x")
    assert httpx.post(url + "/cache/purge", headers=EVIL, data={}, timeout=30).status_code == 403
    assert httpx.post(url + "/cache/purge", timeout=30,
                      headers={"Content-Type": "application/x-www-form-urlencoded"}).status_code == 415
    assert parked(engine) == before
    for headers in (EVIL, {"Content-Type": "application/x-www-form-urlencoded"}):
        assert httpx.post(url + "/shutdown", headers=headers, timeout=30).status_code in (403, 415)
    assert engine.alive() and engine.get_status("/health") == 200


def test_dns_rebinding_hosts_are_refused(engine, tmp_path):
    url = engine.base_url
    for host in ("evil.example", "attacker.test"):
        for path in ("/cache/config", "/v1/models"):
            r = httpx.get(url + path, headers={"Host": host}, timeout=30)
            assert r.status_code == 403 and "--allowed-hosts" in r.json()["error"]["message"]
    target = tmp_path / "planted"
    r = httpx.put(url + "/cache/config", headers={"Host": "evil.example"}, timeout=30,
                  json={"conversation_cache_dir": str(target)})
    assert r.status_code == 403 and not target.exists()


def test_preflight_from_a_web_page_is_refused(engine):
    r = httpx.options(engine.base_url + "/v1/chat/completions", timeout=30,
                      headers={**EVIL, "Access-Control-Request-Method": "POST"})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers


def test_what_the_desktop_app_and_the_sdk_send_still_works(engine):
    pytest.importorskip("PySide6")
    from desktop.client import Dispatcher, EngineClient

    dispatcher = Dispatcher()
    try:
        desktop = EngineClient(dispatcher)
        url = engine.base_url
        assert desktop.call("GET", url + "/health").ok
        assert desktop.call("GET", url + "/cache/config").ok
        assert desktop.call("PUT", url + "/cache/config", json={"conversation_cache_slots": 32}, timeout=30).ok
        assert desktop.call("POST", url + "/cache/purge", json={"tier": "all"}, timeout=30).ok
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        r = client.completions.create(model="m", prompt="hello", max_tokens=2)
        assert r.usage.completion_tokens >= 1
        reply = desktop.call("POST", url + "/shutdown", timeout=30)  # no body, as the app sends it
        assert reply.status == 202, reply.error
        engine.proc.wait(timeout=60)
        assert engine.proc.returncode == 0
    finally:
        dispatcher.close()
