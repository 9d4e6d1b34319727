"""`--api-key`: every route but GET /health answers 401 in OpenAI's error shape without the key."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.engine_process import engine_process
from tests.model_fixtures import write_tiny_model

KEY = "test-key-123"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = write_tiny_model(tmp_path_factory.mktemp("auth-model"), "llama")
    with engine_process("--model", model, "--ctx-size", "256", "--conversation-cache-mib", "0", api_key=KEY) as e:
        yield e


def test_requests_with_the_key_are_served(engine):
    client = openai.OpenAI(base_url=engine.base_url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert r.usage.completion_tokens >= 1
    assert client.models.list().data


def test_sdk_with_a_wrong_key_gets_authentication_error(engine):
    client = openai.OpenAI(base_url=engine.base_url + "/v1", api_key="wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as info:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert info.value.status_code == 401
    assert info.value.body["message"] == "invalid API key"


@pytest.mark.parametrize("method, path", [
    ("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
    ("GET", "/metrics"), ("GET", "/slots"), ("GET", "/cache/conversations"), ("POST", "/cache/purge"),
    ("PUT", "/cache/config"), ("POST", "/shutdown"), ("GET", "/no/such/route"),
])
def test_every_route_refuses_a_request_without_the_key(engine, method, path):
    r = httpx.request(method, engine.base_url + path, json={}, timeout=10)
    assert r.status_code == 401
    assert r.headers["www-authenticate"] == "Bearer"
    err = r.json()["error"]
    assert err["type"] == "authentication_error" and err["code"] == 401
    assert "Authorization: Bearer" in err["message"]
    assert engine.alive()


def test_health_answers_without_the_key_and_says_nothing_else(engine):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(engine.base_url + "/health", headers=headers, timeout=10)
        body = r.json()
        assert (r.status_code, body["status"], body["phase"]) == (200, "ok", "ready")
        assert set(body) == {"status", "phase", "progress", "elapsed_s"}, "only the start-up state, nothing else"
