"""Issues 19.4 / 17.12: the stats routes answer while the engine thread is busy, from the snapshot it publishes,
never by queueing behind a step. In-process with the engine thread held (deterministic), and against a real
engine while it streams a long generation."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from engine.config import EngineConfig
from engine.runtime.engine import Engine
from engine.server.app import ServerState, create_app
from tests.engine_process import engine_process
from tests.model_fixtures import write_tiny_model

STATS_ROUTES = ("/health", "/metrics", "/metrics?format=prometheus", "/cache/conversations", "/cache/events",
                "/cache/requests",
                "/cache/config", "/slots")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("stats")
    config = EngineConfig(model=write_tiny_model(root, "llama"), ctx_size=256, conversation_cache_mib=16,
                          conversation_cache_min_free_mib=0, conversation_cache_dir=str(root / "parked"))
    e = Engine.from_config(config)
    yield e
    e.close()


def test_stats_answer_while_the_engine_thread_is_held(engine):
    http = TestClient(create_app(ServerState(engine.config, engine=engine)), base_url="http://127.0.0.1:8080")
    gate = threading.Event()
    held = engine.call(gate.wait)  # the engine thread now waits: like one very long step
    answers: dict[str, int] = {}

    def ask_all() -> None:
        for path in STATS_ROUTES:
            answers[path] = http.get(path).status_code

    asker = threading.Thread(target=ask_all, daemon=True)
    asker.start()
    asker.join(timeout=30)
    still_held = not held.done()
    gate.set()
    held.result(timeout=60)
    assert still_held
    assert answers == dict.fromkeys(STATS_ROUTES, 200), "a stats route waited on the engine thread"


def test_the_snapshot_counts_a_request_as_soon_as_it_is_answered(engine):
    http = TestClient(create_app(ServerState(engine.config, engine=engine)), base_url="http://127.0.0.1:8080")
    before = http.get("/metrics").json()["engine"]
    r = http.post("/v1/completions", json={"prompt": "count me", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200, r.text
    after = http.get("/metrics").json()["engine"]
    assert after["requests"] == before["requests"] + 1
    assert after["generated_tokens"] == before["generated_tokens"] + 3
    assert after["slots_busy"] == 0 and after["stats_age_s"] >= 0


def test_stats_answer_while_a_real_engine_streams(tmp_path):
    model = write_tiny_model(tmp_path, "llama", max_position_embeddings=4096)
    with engine_process("--model", model, "--ctx-size", "4096") as proc:
        client = openai.OpenAI(base_url=proc.base_url + "/v1", api_key="none", max_retries=0, timeout=120)
        stream = client.completions.create(model="m", prompt="tell me a long story", max_tokens=4000, stream=True,
                                           extra_body={"ignore_eos": True})
        answered = 0
        with httpx.Client(base_url=proc.base_url, timeout=5) as http:
            for i, _chunk in enumerate(stream):
                if i == 1:
                    for n in range(20):
                        r = http.get(STATS_ROUTES[n % len(STATS_ROUTES)])
                        assert r.status_code == 200
                        answered += 1
                    # Still generating when they answered: the slot is busy, the stream goes on.
                    assert http.get("/metrics").json()["engine"]["slots_busy"] == 1
                    assert http.get("/slots").json()[0]["state"] == "busy"
                if i == 3:
                    break
        stream.close()
        assert answered == 20
