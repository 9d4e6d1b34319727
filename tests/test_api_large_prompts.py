"""Issue 19.5: a prompt of several MB is tokenised on a worker thread, so /health and the stats keep answering
while it is; a body over --max-request-mib is refused with a 413 naming the limit."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from tests.engine_process import engine_process
from tests.model_fixtures import write_tiny_model


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = write_tiny_model(tmp_path_factory.mktemp("large-prompts"), "llama")
    with engine_process("--model", model, "--ctx-size", "256", "--max-request-mib", "16") as e:
        yield e


def test_health_and_metrics_answer_while_a_huge_prompt_is_tokenised(engine):
    body = json.dumps({"prompt": "é中" * 1_600_000, "max_tokens": 1}, ensure_ascii=False).encode()  # 8 MB
    outcome: dict = {}

    def send_big() -> None:
        r = httpx.post(engine.base_url + "/v1/completions", content=body, timeout=600,
                       headers={"Content-Type": "application/json"})
        outcome["status"], outcome["error"] = r.status_code, r.json()["error"]["message"]

    big = threading.Thread(target=send_big)
    big.start()
    answered_while_pending = 0
    with httpx.Client(base_url=engine.base_url, timeout=5) as http:
        while big.is_alive():
            # A timeout here (5 s) would mean the server stopped serving while it tokenised.
            assert http.get("/health").json()["status"] == "ok"
            assert http.get("/metrics").status_code == 200
            answered_while_pending += big.is_alive()
    big.join()
    assert outcome["status"] == 400 and "tokens but the context holds 256" in outcome["error"]
    assert answered_while_pending >= 1


def test_a_body_over_the_limit_is_a_413_naming_it(engine):
    body = b'{"prompt": "' + b"x" * (17 << 20) + b'"}'
    r = httpx.post(engine.base_url + "/v1/completions", content=body, timeout=120,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    err = r.json()["error"]
    assert "16 MiB" in err["message"] and "--max-request-mib" in err["message"] and err["code"] == 413
    assert engine.get_status("/health") == 200
