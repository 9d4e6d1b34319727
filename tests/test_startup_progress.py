"""Start-up progress: the phases move forward only, /health serves them while the model loads, and a real
engine started from nothing walks through them in order and ends in "ok"."""

from __future__ import annotations

import threading

import pytest
from fastapi.testclient import TestClient

from engine.config import EngineConfig
from engine.contract import HealthBody, parse
from engine.server.app import ServerState, create_app
from engine.startup_progress import PHASES, READY_PHASE, StartupProgress, report
from tests.engine_process import engine_process


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_phases_move_forward_and_the_summary_gives_each_its_seconds():
    clock = Clock()
    progress = StartupProgress(clock)
    assert progress.health(ready=False) == HealthBody(status="loading", phase=PHASES[0], elapsed_s=0.0)
    clock.now += 2.5
    progress.begin("loading weights")
    progress.advance(3, 12)
    clock.now += 1.0
    body = progress.health(ready=False)
    assert (body.phase, body.progress, body.elapsed_s) == ("loading weights", 0.25, 3.5)
    with pytest.raises(AssertionError, match="after 'loading weights'"):
        progress.begin("reading model file")
    with pytest.raises(AssertionError, match="unknown start-up phase"):
        progress.begin("daydreaming")
    progress.begin("warming up")  # a phase may be skipped (no cache: nothing to index)
    assert progress.health(ready=False).progress is None, "a new phase starts with its fraction unknown"
    clock.now += 0.5
    progress.finish()
    assert progress.summary() == "reading model file 2.50 s, loading weights 1.00 s, warming up 0.50 s"
    clock.now += 60
    assert progress.health(ready=True) == HealthBody(status="ok", phase=READY_PHASE, progress=1.0, elapsed_s=4.0)


def test_report_reaches_only_the_progress_of_its_own_thread():
    mine, other = StartupProgress(), StartupProgress()
    report(1, 2)  # outside any start-up: nothing to report to, no error
    with mine.reporting():
        report(1, 4)

        def other_load() -> None:
            with other.reporting():
                report(3, 4)

        thread = threading.Thread(target=other_load)
        thread.start()
        thread.join()
    report(2, 4)  # after the block: no longer reaches `mine`
    assert mine.health(ready=False).progress == 0.25
    assert other.health(ready=False).progress == 0.75


def test_health_serves_the_loaders_phase_while_every_other_route_answers_503():
    state = ServerState(EngineConfig())
    http = TestClient(create_app(state), base_url="http://127.0.0.1:8080")
    state.progress.begin("loading weights")
    state.progress.advance(15, 30)
    r = http.get("/health")
    body = parse(HealthBody, r.json())
    assert (r.status_code, body.status, body.phase, body.progress) == (503, "loading", "loading weights", 0.5)
    err = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert err.status_code == 503 and "still loading" in err.json()["error"]["message"]


def test_a_real_engine_reports_its_phases_in_order_and_ends_ok(tmp_path):
    answers: list[tuple[int, object]] = []
    with engine_process("--conversation-cache-storage", "disk", "--conversation-cache-dir", str(tmp_path),
                        health_log=answers) as engine:
        logs = engine.logs()
    bodies = [(status, parse(HealthBody, body)) for status, body in answers]
    assert bodies, "GET /health answered"
    status, last = bodies[-1]
    assert (status, last.status, last.phase) == (200, "ok", READY_PHASE)
    for status, body in bodies[:-1]:
        assert (status, body.status) == (503, "loading"), "loading is a 503 with the loading status"
        assert body.phase in PHASES
        assert body.progress is None or 0.0 <= body.progress <= 1.0
    seen = [body.phase for _, body in bodies[:-1]]
    order = [PHASES.index(phase) for phase in seen]
    assert order == sorted(order), f"phases went backwards: {seen}"
    elapsed = [body.elapsed_s for _, body in bodies]
    assert elapsed == sorted(elapsed), "the start-up's seconds only grow"
    # The log line and /health come from the same record: every phase, in order.
    line = next(line for line in logs.splitlines() if "start-up phases:" in line)
    named = [phase for phase in PHASES if phase + " " in line]
    assert named == list(PHASES) and [line.index(p) for p in named] == sorted(line.index(p) for p in named), line
