"""The request guards in-process (no model needed): Host allow-list, CORS preflights, Origin refusals, body type
and size. A request that passes every guard reaches a route, which answers 503 "loading" here."""

from __future__ import annotations

from fastapi.testclient import TestClient

from engine.config import EngineConfig
from engine.server.app import ServerState, create_app


def client(host_header: str = "127.0.0.1:8080", **config) -> TestClient:
    return TestClient(create_app(ServerState(EngineConfig(**config))), base_url=f"http://{host_header}")


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return err


def test_loopback_names_and_the_bound_address_pass_with_any_port():
    for host in ("127.0.0.1:8080", "localhost:1", "LOCALHOST", "[::1]:8080", "localhost."):
        assert client(host).get("/v1/models").status_code == 503, host  # through the guards: loading
    assert client("192.168.1.5:9000", host="192.168.1.5").get("/v1/models").status_code == 503


def test_a_foreign_host_is_refused_naming_the_setting():
    for host in ("evil.example", "attacker.test:8080", "127.0.0.1.evil.example", "192.168.1.5"):
        err = error_of(client(host).get("/cache/config"), 403)
        assert "--allowed-hosts" in err["message"] and "DNS-rebinding" in err["message"], host
        assert err["type"] == "permission_error"


def test_a_wildcard_bind_answers_only_loopback_and_allowed_hosts():
    assert client("10.0.0.7:8080", host="0.0.0.0").get("/v1/models").status_code == 403
    c = client("10.0.0.7:8080", host="0.0.0.0", allowed_hosts="10.0.0.7, box.lan")
    assert c.get("/v1/models").status_code == 503
    assert client("box.lan", host="0.0.0.0", allowed_hosts="10.0.0.7, box.lan").get("/health").status_code == 503
    assert client("anything.example", host="0.0.0.0", allowed_hosts="*").get("/v1/models").status_code == 503


def test_preflights_are_refused_without_cors_origins():
    r = client().options("/v1/chat/completions", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert "cors-origins" in error_of(r, 403)["message"]
    assert "access-control-allow-origin" not in r.headers


def test_preflights_and_requests_of_a_listed_origin_get_cors_headers():
    c = client(cors_origins="http://localhost:3000")
    r = c.options("/v1/chat/completions", headers={
        "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "http://localhost:3000"
    r = c.post("/cache/purge", json={"tier": "all"}, headers={"Origin": "http://localhost:3000"})
    assert r.status_code == 503 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
    # Another origin is still refused.
    assert c.post("/cache/purge", json={}, headers={"Origin": "https://evil.example"}).status_code == 403


def test_state_changing_requests_from_a_foreign_origin_are_refused():
    c = client()
    for path in ("/shutdown", "/cache/purge", "/slots/0?action=erase", "/v1/chat/completions"):
        err = error_of(c.post(path, json={}, headers={"Origin": "https://evil.example"}), 403)
        assert "evil.example" in err["message"]
    assert c.put("/cache/config", json={}, headers={"Origin": "null"}).status_code == 403
    # The server's own origin is not foreign; reads carry no CORS header, so a foreign page cannot read them.
    assert c.post("/cache/purge", json={}, headers={"Origin": "http://127.0.0.1:8080"}).status_code == 503
    r = c.get("/cache/config", headers={"Origin": "https://evil.example"})
    assert r.status_code == 503 and "access-control-allow-origin" not in r.headers


def test_bodies_that_are_not_json_are_refused_with_415():
    c = client()
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        r = c.post("/v1/chat/completions", content=b'{"messages": []}', headers={"Content-Type": content_type})
        err = error_of(r, 415)
        assert "application/json" in err["message"] and content_type.split(";")[0] in err["message"]
    # An empty form post (what a cross-site <form> sends) to a route that takes no body is refused too.
    assert error_of(c.post("/shutdown", headers={"Content-Type": "application/x-www-form-urlencoded"}), 415)
    assert error_of(c.post("/cache/purge", content=b"tier=all"), 415)  # a body without a Content-Type
    # JSON (with a charset) and empty bodies without a Content-Type pass.
    r = c.post("/v1/completions", content=b"{}", headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 503
    assert c.post("/shutdown").status_code == 501  # no CLI hook in-process: the route ran


def test_bodies_over_the_limit_are_refused_with_413_naming_it():
    c = client(max_request_mib=1)
    big = b'{"prompt": "' + b"x" * (1 << 20) + b'"}'
    err = error_of(c.post("/v1/completions", content=big, headers={"Content-Type": "application/json"}), 413)
    assert "1 MiB" in err["message"] and "--max-request-mib" in err["message"]

    def chunks():  # no Content-Length: counted while read
        for _ in range(3):
            yield b"x" * (600 << 10)

    err = error_of(c.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"}), 413)
    assert "1 MiB" in err["message"]
    small = b'{"prompt": "' + b"x" * 1000 + b'"}'
    assert c.post("/v1/completions", content=small, headers={"Content-Type": "application/json"}).status_code == 503


def test_a_wildcard_bind_without_allowed_hosts_says_how_to_reach_it(caplog):
    with caplog.at_level("WARNING", logger="strata.server"):
        client(host="0.0.0.0")
    assert "--allowed-hosts" in caplog.text and "0.0.0.0" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="strata.server"):
        client(host="0.0.0.0", allowed_hosts="box.lan")
        client()
    assert "--allowed-hosts" not in caplog.text
