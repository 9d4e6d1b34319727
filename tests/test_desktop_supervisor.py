"""The engine supervisor against a real child process (the stand-in engine): readiness, crash, stop, pid file."""

from __future__ import annotations

import os

os.environ["QT_QPA_PLATFORM"] = "offscreen"

import json
import signal
import subprocess
import sys
import time

import psutil
import pytest

from desktop.client import Dispatcher, EngineClient
from desktop.engine_process import (
    EngineProcess,
    EngineState,
    ProcessOutcome,
    connect_url,
    engine_command,
)
from desktop.pid_file import read_pid_file, reap_orphan
from engine.config import EngineConfig
from tests.test_desktop_support import FAKE_ENGINE, fake_engine_command

pytestmark = pytest.mark.timeout(60)

# What an engine does before it listens: it stops when its stdin (a pipe) closes.
STOPS_ON_STDIN = ("import os, sys; print('waiting', flush=True); "
                  "[None for _ in iter(lambda: os.read(0, 4096), b'')]; print('stdin closed', flush=True)")


@pytest.fixture
def supervisor(qtbot, tmp_path):
    dispatcher = Dispatcher()
    client = EngineClient(dispatcher)
    proc = EngineProcess(client, tmp_path / "engine.pid")
    yield proc
    proc.kill_and_wait()
    proc.close()
    dispatcher.close()
    client.close()


def wait_state(qtbot, proc: EngineProcess, state: EngineState, timeout: int = 10000) -> None:
    qtbot.waitUntil(lambda: proc.state is state, timeout=timeout)


def test_engine_command_is_python_dash_m_engine_or_the_frozen_app(monkeypatch):
    config = EngineConfig(conversation_cache_storage="disk", port=9000)
    assert engine_command(config)[:4] == [sys.executable, "-m", "engine", "serve"]
    assert engine_command(config, port=0)[-2:] == ["--port", "0"]
    assert engine_command(config, port=0).count("--port") == 1
    monkeypatch.setattr(sys, "frozen", True, raising=False)
    assert engine_command(config)[:2] == [sys.executable, "serve"]
    assert connect_url("0.0.0.0", 80) == "http://127.0.0.1:80"
    assert connect_url("::", 80) == "http://[::1]:80"


def test_start_goes_loading_then_ready_and_streams_output(qtbot, supervisor):
    supervisor.command_for = fake_engine_command("--ready-after", "1.0")
    states: list[EngineState] = []
    supervisor.state_changed.connect(states.append)
    supervisor.start(EngineConfig(port=0))
    wait_state(qtbot, supervisor, EngineState.READY)
    assert states == [EngineState.STARTING, EngineState.LOADING, EngineState.READY]
    assert supervisor.url and supervisor.url.startswith("http://127.0.0.1:")
    assert any("strata: listening on" in line for line in supervisor.lines)
    assert any("stand-in: loading" in line for line in supervisor.lines), "stderr is captured too"
    record = read_pid_file(supervisor.pid_file)
    assert record and record["pid"] == supervisor.pid and record["url"] == supervisor.url
    assert record["app_pid"] == os.getpid()


def test_stop_asks_the_engine_first_and_removes_the_pid_file(qtbot, supervisor):
    supervisor.command_for = fake_engine_command()
    supervisor.start(EngineConfig(port=0))
    wait_state(qtbot, supervisor, EngineState.READY)
    pid = supervisor.pid
    with qtbot.waitSignal(supervisor.ended, timeout=10000) as blocker:
        supervisor.stop()
    outcome: ProcessOutcome = blocker.args[0]
    assert outcome.requested and outcome.exit_code == 0 and not outcome.signalled, "exited by itself via /shutdown"
    assert supervisor.state is EngineState.STOPPED
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    qtbot.waitUntil(lambda: not supervisor.pid_file.exists(), timeout=3000)


def test_stop_kills_an_engine_that_ignores_shutdown_and_its_stdin(qtbot, supervisor):
    supervisor.command_for = fake_engine_command("--ignore-shutdown", "--ignore-term")
    supervisor.shutdown_grace_s = 0.5
    supervisor.start(EngineConfig(port=0))
    wait_state(qtbot, supervisor, EngineState.READY)
    start = time.monotonic()
    with qtbot.waitSignal(supervisor.ended, timeout=10000) as blocker:
        supervisor.stop()
    assert blocker.args[0].signalled and blocker.args[0].exit_code == signal.SIGKILL
    assert time.monotonic() - start < 5
    assert any("killing the engine" in line for line in supervisor.lines)


def test_a_loading_engine_stops_on_its_closed_stdin_and_one_that_ignores_it_is_killed(qtbot, supervisor):
    """Before it listens the engine cannot be asked over HTTP: its stdin closing is the same clean stop."""
    supervisor.command_for = lambda config: [sys.executable, "-c", STOPS_ON_STDIN]
    supervisor.start(EngineConfig(port=0))
    qtbot.waitUntil(lambda: any("waiting" in line for line in supervisor.lines), timeout=10000)
    with qtbot.waitSignal(supervisor.ended, timeout=10000) as blocker:
        supervisor.stop()
    assert blocker.args[0].exit_code == 0 and not blocker.args[0].signalled, supervisor.lines
    assert any("stdin closed" in line for line in supervisor.lines)

    supervisor.command_for = lambda config: [sys.executable, "-c", "import time; print('waiting', flush=True); "
                                             "time.sleep(60)"]
    supervisor.loading_grace_s = 0.5
    supervisor.start(EngineConfig(port=0))
    qtbot.waitUntil(lambda: bool(supervisor.lines) and supervisor.lines[-1] == "waiting", timeout=10000)
    with qtbot.waitSignal(supervisor.ended, timeout=10000) as blocker:
        supervisor.stop()
    assert blocker.args[0].signalled and any("killing the engine" in line for line in supervisor.lines)


def test_at_exit_the_stop_is_waited_for_and_ends_in_the_engines_own_exit(qtbot, supervisor):
    """aboutToQuit (Windows ending the session sends it without a quit request) runs no event loop any more: the
    clean stop is waited for there, and the engine exits by itself."""
    supervisor.command_for = fake_engine_command()
    supervisor.start(EngineConfig(port=0))
    wait_state(qtbot, supervisor, EngineState.READY)
    ended: list[ProcessOutcome] = []
    supervisor.ended.connect(ended.append)
    supervisor.stop_and_wait()
    assert not supervisor.running and ended and ended[0].exit_code == 0 and not ended[0].signalled
    assert not any("killing" in line for line in supervisor.lines), supervisor.lines


def test_crash_is_detected_within_two_seconds_and_restart_brings_it_back(qtbot, supervisor):
    supervisor.command_for = fake_engine_command()
    supervisor.start(EngineConfig(port=0))
    wait_state(qtbot, supervisor, EngineState.READY)
    os.kill(supervisor.pid, signal.SIGKILL)
    start = time.monotonic()
    wait_state(qtbot, supervisor, EngineState.CRASHED, timeout=2000)
    assert time.monotonic() - start < 2
    assert supervisor.outcome.describe() == "was killed by SIGKILL"
    supervisor.restart()
    wait_state(qtbot, supervisor, EngineState.READY)


def test_exit_status_and_last_lines_of_a_failed_start(qtbot, supervisor):
    supervisor.command_for = fake_engine_command("--fail-at-start")
    supervisor.start(EngineConfig(port=0))
    wait_state(qtbot, supervisor, EngineState.CRASHED)
    assert supervisor.outcome.describe() == "refused to start: cannot load the model: 'missing.gguf': no such file"
    assert any("cannot load the model" in line for line in supervisor.lines)


def test_a_refused_configuration_is_never_retried(qtbot, supervisor):
    supervisor.command_for = fake_engine_command("--fail-at-start")
    supervisor.auto_restart = True
    delays: list[float] = []
    supervisor.restart_scheduled.connect(delays.append)
    supervisor.start(EngineConfig(port=0))
    wait_state(qtbot, supervisor, EngineState.CRASHED)
    assert supervisor.outcome.config_error.startswith("cannot load the model")
    assert any("not restarting" in line for line in supervisor.lines)
    qtbot.wait(1500)  # longer than the first back-off: a retry would have started by now
    assert delays == [] and supervisor.state is EngineState.CRASHED and not supervisor.running


def test_exit_status_2_without_the_error_line_is_a_crash_and_is_retried(qtbot, supervisor):
    supervisor.command_for = lambda config: [sys.executable, "-c", "import sys; print('boom'); sys.exit(2)"]
    supervisor.auto_restart = True
    delays: list[float] = []
    supervisor.restart_scheduled.connect(delays.append)
    supervisor.start(EngineConfig(port=0))
    qtbot.waitUntil(lambda: delays == [1.0], timeout=10000)
    assert supervisor.outcome.config_error == "" and supervisor.outcome.describe() == "exited with status 2: boom"
    supervisor.cancel_auto_restart()


def test_missing_executable_is_reported(qtbot, supervisor):
    supervisor.command_for = lambda config: ["/nonexistent/strata-engine", "serve"]
    supervisor.start(EngineConfig(port=0))
    wait_state(qtbot, supervisor, EngineState.CRASHED)
    assert "could not start" in supervisor.outcome.describe()


def test_auto_restart_backs_off(qtbot, supervisor):
    supervisor.command_for = fake_engine_command()
    supervisor.auto_restart = True
    delays: list[float] = []
    supervisor.restart_scheduled.connect(delays.append)
    supervisor.start(EngineConfig(port=0))
    wait_state(qtbot, supervisor, EngineState.READY)
    os.kill(supervisor.pid, signal.SIGKILL)
    wait_state(qtbot, supervisor, EngineState.CRASHED)
    wait_state(qtbot, supervisor, EngineState.READY)
    os.kill(supervisor.pid, signal.SIGKILL)
    wait_state(qtbot, supervisor, EngineState.CRASHED)
    assert delays == [1.0, 2.0]
    supervisor.cancel_auto_restart()


def _spawn_orphan(tmp_path) -> tuple[subprocess.Popen, dict]:
    """An engine whose app is gone: started by a short-lived process that wrote the pid file and died."""
    engine = subprocess.Popen([sys.executable, str(FAKE_ENGINE), "serve", "--port", "0"],
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    line = engine.stdout.readline()
    url = line.split("listening on ")[1].strip()
    dead_app = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_app.wait()
    record = {"pid": engine.pid, "create_time": psutil.Process(engine.pid).create_time(),
              "app_pid": dead_app.pid, "app_create_time": 0.0, "url": url, "command": []}
    (tmp_path / "engine.pid").write_text(json.dumps(record))
    return engine, record


def test_reap_orphan_stops_an_engine_left_by_a_dead_app(tmp_path):
    engine, _ = _spawn_orphan(tmp_path)
    dispatcher = Dispatcher()
    client = EngineClient(dispatcher)
    try:
        message = reap_orphan(tmp_path / "engine.pid", client, grace_s=5)
        assert message and f"pid {engine.pid}" in message
        assert engine.wait(timeout=5) == 0, "stopped through /shutdown, not a signal"
        assert not (tmp_path / "engine.pid").exists()
    finally:
        engine.kill()
        dispatcher.close()


def test_reap_orphan_leaves_a_live_apps_engine_and_unrelated_pids_alone(tmp_path):
    pid_file = tmp_path / "engine.pid"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        # Recorded with a different start time: the pid was reused by an unrelated process.
        pid_file.write_text(json.dumps({"pid": sleeper.pid, "create_time": 1.0, "app_pid": 999999999}))
        assert reap_orphan(pid_file) is None
        assert sleeper.poll() is None and not pid_file.exists()
        # Its app is alive (a parent that is not us): not an orphan.
        parent = psutil.Process(os.getppid())
        pid_file.write_text(json.dumps({"pid": sleeper.pid, "create_time": psutil.Process(sleeper.pid).create_time(),
                                        "app_pid": parent.pid, "app_create_time": parent.create_time()}))
        assert reap_orphan(pid_file) is None
        assert sleeper.poll() is None and pid_file.exists()
    finally:
        sleeper.kill()


def test_engine_error_lines_are_read_as_the_engine_prints_them():
    from desktop.engine_errors import (
        BusyPort,
        PortOwner,
        busy_port,
        config_error,
        describe_busy_port,
        describe_config_error,
    )

    line = "strata serve: error: --host/--port: cannot listen on 127.0.0.1:8080: Address already in use"
    reason = config_error(2, False, ["loading", line])
    assert reason == "--host/--port: cannot listen on 127.0.0.1:8080: Address already in use"
    assert config_error(1, False, [line]) is None and config_error(2, True, [line]) is None
    assert config_error(2, False, ["Traceback (most recent call last):"]) is None
    assert busy_port(reason) == BusyPort("127.0.0.1", 8080)
    assert busy_port("--host/--port: cannot listen on 10.9.9.9:80: Cannot assign requested address") is None
    unknown = PortOwner(None, None, "it belongs to another user or the system")
    assert describe_busy_port(BusyPort("127.0.0.1", 8080), unknown) == (
        "Port 8080 is in use by another program (which one is unknown: it belongs to another user or the system):"
        " choose another port in Settings.")
    assert describe_config_error("cannot load the model: /m.gguf: no such file") == (
        "The engine could not load the model: /m.gguf: no such file. Change it in Settings and start the engine again.")


def test_a_refused_start_points_at_its_setting():
    from desktop.engine_errors import setting_for_error

    assert setting_for_error("--host/--port: cannot listen on 127.0.0.1:80: Permission denied") == "port"
    assert setting_for_error("--ctx-size: expected a whole number from 1 to 1048576, got \"0\"") == "ctx_size"
    assert setting_for_error("conversation cache: folder is locked by another engine") == "conversation_cache_dir"
    assert setting_for_error("cannot load the model: no such file") == "model"


def test_reap_orphan_stops_an_engine_started_with_an_api_key_through_shutdown(tmp_path):
    """The orphan's stdin is still open here (as when its app hangs rather than dies): only an authorised
    /shutdown stops it cleanly before the grace ends, and a kill would exit with a signal."""
    from tests.engine_process import start_engine

    real = start_engine("--model", "", "--ctx-size", "256", "--parallel", "1", api_key="orphan-key")
    dead_app = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_app.wait()
    (tmp_path / "engine.pid").write_text(json.dumps({
        "pid": real.proc.pid, "create_time": psutil.Process(real.proc.pid).create_time(), "app_pid": dead_app.pid,
        "app_create_time": 0.0, "url": real.base_url, "command": []}))
    dispatcher = Dispatcher()
    try:
        started = time.monotonic()
        assert reap_orphan(tmp_path / "engine.pid", EngineClient(dispatcher), grace_s=60, api_key="orphan-key")
        assert real.proc.wait(timeout=5) == 0, "stopped by /shutdown, not killed"
        assert time.monotonic() - started < 30
    finally:
        real.stop()
        dispatcher.close()


def test_the_command_shown_and_recorded_holds_no_secret():
    command = ["strata", "serve", "--api-key", "sekrit", "--conversation-cache-remote",
               "redis://:hunter2@127.0.0.1:6379/0", "--port", "0"]
    shown = " ".join(EngineProcess.masked_command(command))
    assert "sekrit" not in shown and "hunter2" not in shown, shown
    assert "--api-key *** " in shown and "redis://:***@127.0.0.1:6379/0" in shown
