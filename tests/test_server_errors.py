"""Domain errors of the runtime and the cache become HTTP statuses and OpenAI's error shape in the server only."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from engine.config import EngineConfig
from engine.errors import BadValue, Busy, EngineError, NotFound, Refused, Unavailable
from engine.server.app import ServerState, create_app

KINDS = [
    (BadValue, 400, "invalid_request_error"),
    (NotFound, 404, "not_found_error"),
    (Busy, 409, "invalid_request_error"),
    (Refused, 409, "invalid_request_error"),
    (Unavailable, 503, "unavailable_error"),
]


@pytest.mark.parametrize(("kind", "status", "type_"), KINDS)
def test_each_domain_error_is_one_status_in_openai_shape(kind, status, type_):
    app = create_app(ServerState(EngineConfig()))

    def boom() -> None:
        raise kind("slot 3 is busy with a request; try again when it is idle", param="id")

    app.add_api_route("/boom", boom, methods=["POST"])
    r = TestClient(app, base_url="http://127.0.0.1:8080", raise_server_exceptions=False).post("/boom")
    assert r.status_code == status
    assert r.json() == {"error": {"message": "slot 3 is busy with a request; try again when it is idle",
                                  "type": type_, "param": "id", "code": status}}


def test_runtime_and_cache_raise_no_http_errors():
    """Nothing below engine/server/ knows HTTP: no ApiError and no status code in the runtime or the cache."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1] / "engine"
    for package in ("runtime", "cache", "kv", "model"):
        for path in (root / package).rglob("*.py"):
            text = path.read_text()
            assert "ApiError" not in text and "status_code" not in text, path
    assert issubclass(Busy, EngineError) and not issubclass(EngineError, OSError)
