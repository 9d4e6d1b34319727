"""The HTTP layer before a model is loaded: loading state, the API-key guard, error shape, /shutdown."""

from __future__ import annotations

from fastapi.testclient import TestClient

from engine.config import EngineConfig
from engine.contract import HealthBody, parse
from engine.server.app import ServerState, create_app
from engine.startup_progress import PHASES


def client(**config) -> tuple[TestClient, ServerState]:
    state = ServerState(EngineConfig(**config))
    return TestClient(create_app(state), base_url="http://127.0.0.1:8080"), state


def assert_openai_error(response, status: int) -> dict:
    assert response.status_code == status
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    return err


def test_health_reports_loading_and_other_routes_answer_503_while_the_model_loads():
    c, _ = client()
    r = c.get("/health")
    body = parse(HealthBody, r.json())
    assert (r.status_code, body.status, body.phase) == (503, "loading", PHASES[0])
    for method, path in [("post", "/v1/chat/completions"), ("post", "/v1/completions"), ("get", "/v1/models"),
                         ("get", "/metrics"), ("get", "/slots"), ("get", "/cache/conversations")]:
        err = assert_openai_error(getattr(c, method)(path), 503)
        assert "loading" in err["message"]


def test_unknown_route_and_wrong_method_are_openai_errors():
    c, _ = client()
    assert assert_openai_error(c.get("/v2/nothing"), 404)["type"] == "not_found_error"
    assert_openai_error(c.get("/v1/chat/completions"), 405)


def test_api_key_guards_every_route_but_health():
    c, _ = client(api_key="s3cret")
    assert (c.get("/health").status_code, c.get("/health").json()["status"]) == (503, "loading")
    assert_openai_error(c.post("/health"), 401)  # only reading the health is open
    for path in ("/v1/models", "/metrics", "/nothing", "/health/x"):
        err = assert_openai_error(c.get(path), 401)
        assert err["type"] == "authentication_error"
        assert "Authorization: Bearer" in err["message"]
    assert "invalid" in assert_openai_error(c.get("/metrics", headers={"Authorization": "Bearer nope"}), 401)["message"]
    assert c.get("/metrics", headers={"Authorization": "Bearer s3cret"}).status_code == 503  # through: loading
    assert c.get("/metrics", headers={"Authorization": "bearer s3cret"}).status_code == 503
    assert c.get("/metrics", headers={"Authorization": "Bearer S3CRET"}).status_code == 401


def test_shutdown_answers_then_calls_the_cli_hook():
    c, state = client()
    assert_openai_error(c.post("/shutdown"), 501)
    calls = []
    state.shutdown = lambda: calls.append("stop")
    r = c.post("/shutdown")
    assert (r.status_code, r.json()) == (202, {"status": "shutting down"})
    assert calls == ["stop"]


def test_openapi_document_lists_every_route_with_its_body_and_error_shape():
    c, _ = client()
    doc = c.get("/openapi.json").json()
    paths = doc["paths"]
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/slots",
                 "/slots/{slot_id}", "/cache/conversations", "/cache/events", "/cache/purge", "/cache/config",
                 "/shutdown"):
        assert path in paths, path
    chat = paths["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatCompletionRequest"}
    assert "messages" in doc["components"]["schemas"]["ChatCompletionRequest"]["required"]
    live = paths["/cache/config"]["put"]["requestBody"]["content"]["application/json"]["schema"]
    assert "conversation_cache_mib" in live["properties"] and "ctx_size" not in live["properties"]
    assert all("default" in op["responses"] and "422" not in op["responses"]
               for methods in paths.values() for op in methods.values())
    assert c.get("/docs").status_code == 404  # no page that would load scripts from a CDN


def test_head_health_answers_like_get_without_a_body():
    c, _ = client(api_key="s3cret")  # open without the key, as GET is
    get, head = c.get("/health"), c.head("/health")
    assert (head.status_code, head.content) == (get.status_code, b"") == (503, b"")
    assert head.headers["content-type"] == get.headers["content-type"]
