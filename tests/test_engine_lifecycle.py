"""`strata serve` start-up and shutdown as a process: every clean way out exits 0; a bad model exits 2."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request

import pytest

from tests.engine_process import REPO, engine_process, start_engine
from tests.model_fixtures import write_tiny_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("lifecycle"), "llama")


def test_post_shutdown_exits_0_with_stdin_still_open(tiny_model):
    engine = start_engine("--model", tiny_model)
    try:
        urllib.request.urlopen(urllib.request.Request(engine.base_url + "/shutdown", method="POST"), timeout=10)
        assert engine.proc.wait(timeout=60) == 0, engine.logs()
        assert "Fatal Python error" not in engine.logs()
    finally:
        engine.stop()


def test_closing_stdin_shuts_down_cleanly(tiny_model):
    engine = start_engine("--model", tiny_model)
    try:
        engine.proc.stdin.close()
        assert engine.proc.wait(timeout=60) == 0, engine.logs()
        assert "stdin closed" in engine.logs()
    finally:
        engine.stop()


@pytest.mark.skipif(os.name == "nt", reason="POSIX signals")
def test_sigint_parks_the_live_slot_and_exits_0(tiny_model, tmp_path):
    engine = start_engine("--model", tiny_model, "--conversation-cache-storage", "disk",
                          "--conversation-cache-dir", str(tmp_path))
    try:
        body = b'{"prompt": "' + b"a quiet harbour at dawn " * 8 + b'", "max_tokens": 4}'
        request = urllib.request.Request(engine.base_url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=60).read()
        engine.proc.send_signal(signal.SIGINT)
        assert engine.proc.wait(timeout=60) == 0, engine.logs()
        assert "parked" in engine.logs()
    finally:
        engine.stop()
    assert any(name.startswith("conv-") for _, _, files in os.walk(tmp_path) for name in files)


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda d: os.path.join(d, "missing.gguf"), "no such file"),
        (lambda d: _write(os.path.join(d, "garbage.gguf"), b"GGUF" + os.urandom(64)), "garbage.gguf"),
        (lambda d: _write(os.path.join(d, "not-a-model.gguf"), b"hello"), "not-a-model.gguf"),
    ],
)
def test_model_that_cannot_load_exits_2_with_one_clear_line(tmp_path, make, reason):
    path = make(str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "engine", "serve", "--port", "0", "--model", path], cwd=REPO,
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("strata serve: error: cannot load the model:"), proc.stderr
    assert reason in errors[0].lower() or reason in errors[0], errors[0]


def _write(path: str, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return path


def test_second_engine_on_the_same_cache_folder_is_refused_at_start(tiny_model, tmp_path):
    flags = ("--model", tiny_model, "--conversation-cache-storage", "disk", "--conversation-cache-dir", str(tmp_path))
    first = start_engine(*flags)
    try:
        proc = subprocess.run([sys.executable, "-m", "engine", "serve", "--port", "0", *flags], cwd=REPO,
                              capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        assert proc.returncode == 2, proc.stderr
        assert "strata serve: error: conversation cache:" in proc.stderr, proc.stderr
        assert first.get_status("/health") == 200  # the first engine keeps serving
    finally:
        first.stop()


@pytest.mark.parametrize("policy", [None, "ACTIVE"])
def test_threads_and_sleeping_workers_are_what_the_engine_runs_with(tiny_model, policy):
    """--threads is honoured, idle OpenMP workers sleep by default, and a wait policy the user set stays."""
    if policy is None and "OMP_WAIT_POLICY" in os.environ:
        pytest.skip("OMP_WAIT_POLICY is set in this environment")
    env = {"OMP_WAIT_POLICY": policy} if policy else {}
    with engine_process("--model", tiny_model, "--threads", "1", "--conversation-cache-mib", "0", env=env) as engine:
        request = urllib.request.Request(engine.base_url + "/metrics", headers={"Accept": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            stats = json.loads(response.read())["engine"]
    assert stats["threads"] == 1
    assert stats["decode_threads"] == 1  # a tiny model decodes on one thread by default
    assert stats["omp_wait_policy"] == (policy or "PASSIVE")


def test_sigterm_with_streams_in_flight_ends_them_and_exits_at_once_without_tracebacks():
    import threading
    import time

    import httpx

    with engine_process("--model", "", "--parallel", "2", "--ctx-size", "2048") as engine:
        ends: list[str] = []

        def stream(i: int) -> None:
            body = {"messages": [{"role": "user", "content": f"A story, part {i}."}], "max_tokens": 1500,
                    "stream": True, "ignore_eos": True}
            try:
                with httpx.stream("POST", engine.base_url + "/v1/chat/completions", json=body, timeout=60) as r:
                    ends.extend("done" if line == "data: [DONE]" else "shut" for line in r.iter_lines()
                                if line == "data: [DONE]" or ('"error"' in line and "shutting down" in line))
            except httpx.HTTPError:
                ends.append("cut")

        clients = [threading.Thread(target=stream, args=(i,)) for i in range(3)]  # two served, one queued
        for c in clients:
            c.start()
        time.sleep(3)
        started = time.monotonic()
        assert engine.stop() == 0
        took = time.monotonic() - started
        for c in clients:
            c.join(30)
        logs = engine.logs()
    assert took < 4, f"shutdown took {took:.1f} s: the server's graceful timeout cancelled the streams"
    assert "Traceback" not in logs and "CancelledError" not in logs, logs[-3000:]
    # the streams in flight were ended, not cut, and as failures: a cut answer is no finished one
    assert ends.count("shut") == 3 and "done" not in ends, ends
