"""Large requests: a prompt longer than the context could hold in any tokenization is refused from its length,
before it is tokenized (which took seconds and 90-140x its size in RAM); a body over --max-request-mib is refused
with a 413 naming the limit."""

from __future__ import annotations

import json
import threading
import time

import httpx
import psutil
import pytest

from tests.engine_process import engine_process
from tests.model_fixtures import write_tiny_model


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = write_tiny_model(tmp_path_factory.mktemp("large-prompts"), "llama")
    with engine_process("--model", model, "--ctx-size", "256", "--max-request-mib", "16") as e:
        yield e


# The most a request may add to the engine's peak RSS, in multiples of its body (docs/API.md): its bytes, the JSON
# parse's strings, the validated copy. Measured 2-3.1x for 8 MB prompts.
PEAK_FACTOR = 5


def _peak_rss_during(pid: int, work) -> tuple[int, int]:
    """(RSS before, highest RSS seen while `work()` runs), sampled every 20 ms."""
    proc = psutil.Process(pid)
    before = proc.memory_info().rss
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        work()
    finally:
        done.set()
        sampler.join()
    return before, peak[0]


def test_a_prompt_no_tokenization_could_fit_is_refused_before_it_is_tokenized(engine):
    body = json.dumps({"prompt": "é中" * 1_600_000, "max_tokens": 1}, ensure_ascii=False).encode()  # 8 MB
    chat = json.dumps({"messages": [{"role": "user", "content": "x" * (8 << 20)}], "max_tokens": 1}).encode()
    for route, data in (("/v1/completions", body), ("/v1/chat/completions", chat)):
        replies = []

        def send(route=route, data=data, replies=replies) -> None:
            started = time.monotonic()
            replies.append((httpx.post(engine.base_url + route, content=data, timeout=600,
                                       headers={"Content-Type": "application/json"}), time.monotonic() - started))

        before, peak = _peak_rss_during(engine.proc.pid, send)
        [(r, seconds)] = replies
        assert r.status_code == 400, r.text[:300]
        assert "more than the context can hold in any tokenization" in r.json()["error"]["message"]
        # Tokenizing 8 MB took seconds and ~1 GB; refused from its length, the body's parse is the cost.
        assert seconds < 20
        assert peak - before < PEAK_FACTOR * len(data), f"{route}: RSS {before >> 20} -> {peak >> 20} MiB"
    assert engine.get_status("/health") == 200


def test_a_body_over_the_limit_is_a_413_naming_it(engine):
    body = b'{"prompt": "' + b"x" * (17 << 20) + b'"}'
    r = httpx.post(engine.base_url + "/v1/completions", content=body, timeout=120,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    err = r.json()["error"]
    assert "16 MiB" in err["message"] and "--max-request-mib" in err["message"] and err["code"] == 413
    assert engine.get_status("/health") == 200
