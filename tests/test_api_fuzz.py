"""Issue 19.9 / standards: every route, fuzzed from the server's own /openapi.json with schemathesis against a
real engine, answers 4xx in its API's error shape (OpenAI's; Anthropic's for the Messages API) for what it refuses and never a 5xx; the server keeps serving.
Bounded examples per route (seeded), so the whole run stays within a couple of minutes."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.engine_process import engine_process
from tests.model_fixtures import write_tiny_model

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")

EXAMPLES_PER_ROUTE = 20
SKIPPED = {("POST", "/shutdown")}  # it would stop the server under test; tests/test_api_control.py covers it


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    model = write_tiny_model(root, "llama")
    # Run from a scratch folder: a fuzzed relative conversation_cache_dir lands there, not in the repository.
    with engine_process("--model", model, "--ctx-size", "256", "--slot-save-path", str(root / "slots"),
                        "--conversation-cache-dir", str(root / "parked"), "--conversation-cache-mib", "32",
                        "--conversation-cache-min-free-mib", "0", cwd=str(root)) as e:
        yield e


def assert_api_error(status: int, body: bytes, what: str) -> None:
    """A 4xx in the shape of the route's API: Anthropic's under /v1/messages, OpenAI's everywhere else."""
    assert status < 500, f"{what} -> {status}: {body[:500]!r}"
    if status >= 400 and " /v1/messages" in what:
        parsed = json.loads(body)
        assert parsed["type"] == "error" and set(parsed["error"]) == {"type", "message"}, f"{what}: {body[:500]!r}"
        assert parsed["error"]["message"], what
    elif status >= 400:
        err = json.loads(body)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], f"{what}: {body[:500]!r}"
        assert err["code"] == status, what


@pytest.mark.slow
def test_every_route_survives_fuzzing_from_its_openapi_document(engine):
    from hypothesis import HealthCheck, given, settings

    document = httpx.get(engine.base_url + "/openapi.json", timeout=30).json()
    schema = schemathesis.openapi.from_dict(document)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 12
    seen = 0
    for operation in operations:
        if (operation.method.upper(), operation.path) in SKIPPED:
            continue

        @settings(max_examples=EXAMPLES_PER_ROUTE, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def fuzz(case) -> None:
            nonlocal seen
            response = case.call(base_url=engine.base_url, timeout=60)
            seen += 1
            assert_api_error(response.status_code, response.content, f"{case.method} {case.formatted_path}")

        fuzz()
    assert seen >= 100
    assert engine.alive() and engine.get_status("/health") == 200
    assert "Traceback" not in engine.logs()
