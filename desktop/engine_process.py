"""The engine child process: start, readiness, logs, crash detection, clean stop, and the pid file.

One `EngineProcess` wraps one QProcess. States: stopped -> starting (spawned) -> loading (listening, /health
says 503) -> ready (/health 200) -> stopping -> stopped, or crashed when it ends without being asked to.
A stop asks the engine itself (`POST /shutdown`, and its stdin closed) and waits for its own exit, in which it
parks its live slots and a tiered cache spills to disk; only an engine that has not exited by the deadline is
killed. Never terminate(): on Windows that is TerminateProcess, the same crash as a kill, taken mid-spill.
A pid file records the running engine so that one orphaned by a crash of the app is found and stopped at the
next launch (`desktop.pid_file.reap_orphan`).
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, QProcess, QProcessEnvironment, QTimer, Signal

import engine
from desktop.client import EngineClient, Reply
from desktop.engine_errors import config_error, refused_words
from desktop.log_files import APP_PREFIX
from desktop.pid_file import read_pid_file, write_pid_file
from engine.config import EngineConfig, all_settings
from engine.contract import ContractError, HealthBody, parse
from engine.store_url import redact_url

LISTENING = re.compile(r"strata: listening on (https?://\S+)")
LOG_LINES = 5000  # lines kept in memory for the Logs tab and the crash report
# How long a stopping engine is given before it is killed. A serving one: its own shutdown deadline is 60 s
# (engine/cli.py: finish the requests in flight, park the live slots, spill the RAM tier), then its server's
# 5 s graceful stop and the interpreter's exit. One still starting or loading has nothing parked yet.
SHUTDOWN_GRACE_S = 90.0
LOADING_GRACE_S = 20.0


class EngineState(StrEnum):
    STOPPED = "stopped"
    STARTING = "starting"
    LOADING = "loading"
    READY = "ready"
    STOPPING = "stopping"
    CRASHED = "crashed"

    @property
    def running(self) -> bool:
        return self in (EngineState.STARTING, EngineState.LOADING, EngineState.READY, EngineState.STOPPING)

    @property
    def label(self) -> str:
        return {
            "stopped": "Stopped", "starting": "Starting…", "loading": "Loading model…", "ready": "Ready",
            "stopping": "Stopping…", "crashed": "Crashed",
        }[self.value]


def state_words(state: EngineState, outcome: ProcessOutcome | None) -> str:
    """The state as the header and the tray say it: a start the engine refused (its settings, a busy port: exit
    status 2 and its reason) is "Not started: port 8080 is in use", not "Crashed"."""
    if state is EngineState.CRASHED and outcome is not None and outcome.config_error:
        return f"Not started: {refused_words(outcome.config_error)}"
    return state.label


def engine_command(config: EngineConfig, port: int | None = None) -> list[str]:
    """The command that starts the engine: `python -m engine serve ...`, or the bundled executable when frozen."""
    args = config.to_args()
    if port is not None:
        args = _without_flag(args, "--port") + ["--port", str(port)]
    if getattr(sys, "frozen", False):
        # A frozen app is its own interpreter: desktop.app.main dispatches "serve" before importing Qt.
        return [sys.executable, "serve", *args]
    return [sys.executable, "-m", "engine", "serve", *args]


def _without_flag(args: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a == flag:
            skip = True
            continue
        out.append(a)
    return out


def connect_url(host: str, port: int) -> str:
    """The URL a client uses to reach an engine bound to host:port (a wildcard bind is reached on loopback)."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


@dataclass(frozen=True, slots=True)
class ProcessOutcome:
    """How the engine process ended."""

    exit_code: int | None  # exit status, or the signal number when killed by one
    signalled: bool
    requested: bool  # the app asked it to stop
    error: str = ""  # it could not be started at all
    config_error: str = ""  # it refused its configuration (exit status 2 and its error line): never retried
    last_line: str = ""  # its last line of output (a traceback's last line names the error)

    @property
    def clean(self) -> bool:
        return self.requested or (not self.signalled and self.exit_code == 0 and not self.error)

    def describe(self) -> str:
        if self.error:
            return self.error
        if self.config_error:
            return f"refused to start: {self.config_error}"
        if self.signalled:
            try:
                name = signal.Signals(self.exit_code or 0).name
            except ValueError:
                name = f"signal {self.exit_code}"
            return f"was killed by {name}" if not self.requested else f"stopped ({name})"
        if self.exit_code == 0:
            return "exited normally"
        return f"exited with status {self.exit_code}" + (f": {self.last_line}" if self.last_line else "")


# ---------------------------------------------------------------------------------------------- the process


class EngineProcess(QObject):
    """Supervises one engine child process."""

    state_changed = Signal(object)  # EngineState
    line = Signal(str)  # one line of the engine's output
    url_changed = Signal(object)  # str | None
    ended = Signal(object)  # ProcessOutcome
    restart_scheduled = Signal(float)  # seconds until an automatic restart
    health_changed = Signal(object)  # HealthBody | None: the start-up phase while it loads

    def __init__(self, client: EngineClient, pid_file: Path | None = None, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.client = client
        self.pid_file = pid_file
        self.state = EngineState.STOPPED
        self.url: str | None = None
        self.config: EngineConfig | None = None  # what the running engine was started with
        self.command: list[str] = []
        self.outcome: ProcessOutcome | None = None
        self.lines: collections.deque[str] = collections.deque(maxlen=LOG_LINES)
        self.auto_restart = False
        self.command_for: Callable[[EngineConfig], list[str]] = engine_command  # how to start it (one place)
        self.shutdown_grace_s = SHUTDOWN_GRACE_S
        self.loading_grace_s = LOADING_GRACE_S
        self.started_at: float | None = None
        self.health: HealthBody | None = None  # the last /health answer of this run (None before the first)
        self._proc: QProcess | None = None
        # Pid-file writes and removals run off the GUI thread, in order.
        self._files = ThreadPoolExecutor(max_workers=1, thread_name_prefix="strata-pid-file")
        self._partial = ""
        self._stop_requested = False
        self._restart_after_stop = False
        self._closed = False  # close() ran: the app is quitting, no engine starts again
        self._next_config: EngineConfig | None = None
        self._backoff_s = 1.0
        self._health_in_flight = False
        self._health_timer = QTimer(self, interval=250)
        self._health_timer.timeout.connect(self._check_health)
        self._kill_timer = QTimer(self, singleShot=True)
        self._kill_timer.timeout.connect(self.kill)
        self._auto_timer = QTimer(self, singleShot=True)
        self._auto_timer.timeout.connect(self._auto_restart)

    # ------------------------------------------------------------------ properties

    @property
    def pid(self) -> int | None:
        if self._proc is None or self._proc.state() == QProcess.ProcessState.NotRunning:
            return None
        pid = self._proc.processId()
        return int(pid) if pid else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.state() != QProcess.ProcessState.NotRunning

    @property
    def state_text(self) -> str:
        """The state in words, with why a start was refused ("Not started: port 8080 is in use")."""
        return state_words(self.state, self.outcome)

    # ------------------------------------------------------------------ control

    def start(self, config: EngineConfig) -> None:
        """Start the engine with `config`. Does nothing if one is already running."""
        if self.running:
            return
        self._auto_timer.stop()
        self.config = config
        self.command = self.command_for(config)
        self.outcome = None
        self._stop_requested = False
        self._partial = ""
        proc = QProcess(self)
        env = QProcessEnvironment.systemEnvironment()
        env.insert("PYTHONUNBUFFERED", "1")
        if not getattr(sys, "frozen", False):
            # The child imports the same `engine` package this app reads its settings table from,
            # also from a source checkout that is not installed.
            root = str(Path(engine.__file__).resolve().parent.parent)
            paths = [root, *[p for p in env.value("PYTHONPATH", "").split(os.pathsep) if p and p != root]]
            env.insert("PYTHONPATH", os.pathsep.join(paths))
        proc.setProcessEnvironment(env)
        proc.setProcessChannelMode(QProcess.ProcessChannelMode.MergedChannels)
        proc.readyReadStandardOutput.connect(self._read_output)
        proc.finished.connect(self._on_finished)
        proc.errorOccurred.connect(self._on_error)
        self._proc = proc
        self._emit_line("strata-desktop: starting " + " ".join(self.masked_command(self.command)))
        self._set_url(None)
        self._set_health(None)
        self._set_state(EngineState.STARTING)
        self.started_at = time.time()
        if sys.platform == "win32" and hasattr(proc, "setCreateProcessArgumentsModifier"):
            def no_console(args: Any) -> None:
                args.flags |= 0x08000000  # CREATE_NO_WINDOW: the GUI app's child opens no console window

            proc.setCreateProcessArgumentsModifier(no_console)
        proc.started.connect(self._write_pid_file)
        proc.start(self.command[0], self.command[1:])

    def stop(self) -> None:
        """Stop cleanly: POST /shutdown and close the engine's stdin, then wait for its own exit; kill it only
        when it has not exited by the deadline."""
        self._auto_timer.stop()
        if not self.running:
            if self.state is EngineState.CRASHED:
                self._set_state(EngineState.STOPPED)
            return
        if self.state is EngineState.STOPPING:
            return
        self._stop_requested = True
        self._health_timer.stop()
        serving = self.state is EngineState.READY
        listening = self.state in (EngineState.READY, EngineState.LOADING) and self.url is not None
        self._set_state(EngineState.STOPPING)
        if listening:
            self._emit_line("strata-desktop: asking the engine to shut down (POST /shutdown)")
            self.client.request("POST", "/shutdown", self._on_shutdown_reply, timeout=3.0)
        else:
            self._emit_line("strata-desktop: asking the engine to shut down (closing its stdin)")
            self._close_stdin()
        grace = self.shutdown_grace_s if serving else self.loading_grace_s
        self._kill_timer.start(int(grace * 1000))

    def _close_stdin(self) -> None:
        """The engine shuts down cleanly when its stdin closes: the request that reaches it whether it listens
        yet or not, and whatever became of an HTTP request."""
        if self._proc is not None:
            self._proc.closeWriteChannel()

    def stop_and_wait(self) -> None:
        """The clean stop, waited for here: at exit, when no event loop runs any more. Waits for the engine's own
        exit until the stop's deadline, then kills it: no engine may outlive the app."""
        self.stop()
        self._close_stdin()  # no event loop will deliver the answer to the POST, after which it would be closed
        if self.running:
            self._proc.waitForFinished(max(self._kill_timer.remainingTime(), 0))
        if self.running:
            self.kill()
            self._proc.waitForFinished(3000)

    def restart(self, config: EngineConfig | None = None) -> None:
        """Stop (if running) and start again, with `config` or the last one."""
        self._next_config = config or self.config
        if self.running:
            self._restart_after_stop = True
            self.stop()
        else:
            assert self._next_config is not None, "restart() before any start()"
            self.start(self._next_config)

    def kill(self) -> None:
        if self.running:
            self._emit_line("strata-desktop: killing the engine")
            self._stop_requested = True
            self._proc.kill()

    def kill_and_wait(self, timeout_ms: int = 3000) -> None:
        """Last resort at exit: no engine may outlive the app."""
        self._auto_timer.stop()
        if self.running:
            self._stop_requested = True
            self._proc.kill()
            self._proc.waitForFinished(timeout_ms)

    # ------------------------------------------------------------------ internals

    def _on_shutdown_reply(self, reply: Reply) -> None:
        """Close the engine's stdin once the POST is answered (not before: an engine the closed stdin stopped
        already would drop the request's connection). A failed POST is left to the stdin: an engine that is
        stopping already drops the connection, and killing it would lose what it is parking and spilling."""
        if not self.running:
            return
        if not reply.ok:
            self._emit_line(f"strata-desktop: /shutdown failed ({reply.error}); closing the engine's stdin and "
                            "waiting for it to exit")
        self._close_stdin()

    @staticmethod
    def masked_command(command: list[str]) -> list[str]:
        """`command` as the Logs tab, desktop.log and the pid file show it: a secret flag's value (--api-key) as
        ***, and a URL's password (a Redis store's) as ***."""
        secret = {spec.flag for _, spec, _ in all_settings() if spec.secret}
        return [("***" if i > 0 and command[i - 1] in secret else redact_url(a) if "://" in a else a)
                for i, a in enumerate(command)]

    def _set_state(self, state: EngineState) -> None:
        if state is not self.state:
            self.state = state
            self.state_changed.emit(state)

    def _set_url(self, url: str | None) -> None:
        if url != self.url:
            self.url = url
            self.url_changed.emit(url)

    def _emit_line(self, text: str) -> None:
        self.lines.append(text)
        self.line.emit(text)

    def _read_output(self) -> None:
        proc = self.sender()
        if not isinstance(proc, QProcess) or proc is not self._proc:
            return
        chunk = bytes(proc.readAllStandardOutput().data()).decode("utf-8", errors="replace")
        text = self._partial + chunk.replace("\r\n", "\n")
        *complete, self._partial = text.split("\n")
        for raw in complete:
            self._emit_line(raw)
            m = LISTENING.search(raw)
            if m:
                self._on_listening(m.group(1))

    def _on_listening(self, url: str) -> None:
        url = url.rstrip("/")
        host_port = url.split("://", 1)[1]
        host, _, port = host_port.rpartition(":")
        with contextlib.suppress(ValueError):
            url = connect_url(host.strip("[]"), int(port))
        self.client.set_target(url, self.config.api_key if self.config else None)
        self._set_url(url)
        if self.state is EngineState.STARTING:
            self._set_state(EngineState.LOADING)
        self._write_pid_file()
        self._health_timer.start()
        self._check_health()

    def _write_pid_file(self) -> None:
        if self.pid_file is None or self.pid is None:
            return
        pid, url, command, path = self.pid, self.url, self.masked_command(self.command), self.pid_file  # no secrets on disk
        self._files.submit(write_pid_file, path, pid, url, command)

    def _remove_pid_file(self) -> None:
        if self.pid_file is None:
            return
        path = self.pid_file

        def remove() -> None:
            # Only our own record: a newer engine may already have written its own.
            record = read_pid_file(path)
            if record is None or record.get("app_pid") == os.getpid():
                with contextlib.suppress(OSError):
                    path.unlink()

        self._files.submit(remove)

    def _check_health(self) -> None:
        if self._health_in_flight or self.state not in (EngineState.STARTING, EngineState.LOADING):
            if self.state not in (EngineState.STARTING, EngineState.LOADING):
                self._health_timer.stop()
            return
        self._health_in_flight = True
        self.client.request("GET", "/health", self._on_health, timeout=2.0)

    def _set_health(self, health: HealthBody | None) -> None:
        if health != self.health:
            self.health = health
            self.health_changed.emit(health)

    def _on_health(self, reply: Reply) -> None:
        self._health_in_flight = False
        if self.state not in (EngineState.STARTING, EngineState.LOADING):
            return
        if reply.reachable:
            try:
                self._set_health(parse(HealthBody, reply.data, "GET /health"))
            except ContractError as exc:  # the state still follows the status code; only the phase is unknown
                message = f"strata-desktop: the engine's /health answer is not understood: {exc}"
                if not self.lines or self.lines[-1] != message:  # once, not at every poll
                    self._emit_line(message)
                self._set_health(None)
        if reply.ok:
            self._health_timer.stop()
            self._set_state(EngineState.READY)
        elif reply.reachable:
            self._set_state(EngineState.LOADING)

    def _on_error(self, error: QProcess.ProcessError) -> None:
        if error == QProcess.ProcessError.FailedToStart and self.sender() is self._proc:
            message = f"could not start {self.command[0]!r}: {self._proc.errorString()}"
            self._emit_line("strata-desktop: " + message)
            self._finish(ProcessOutcome(None, False, False, error=message))

    def _on_finished(self, exit_code: int, exit_status: QProcess.ExitStatus) -> None:
        if self.sender() is not self._proc:
            return
        if self._partial:
            self._emit_line(self._partial)
            self._partial = ""
        signalled = exit_status == QProcess.ExitStatus.CrashExit
        tail = list(self.lines)[-20:]
        reason = config_error(int(exit_code), signalled, tail)
        last = next((line.strip() for line in reversed(tail) if line.strip() and not line.startswith(APP_PREFIX)), "")
        self._finish(ProcessOutcome(int(exit_code), signalled, self._stop_requested, config_error=reason or "",
                                    last_line=last[:300]))

    def _finish(self, outcome: ProcessOutcome) -> None:
        self._health_timer.stop()
        self._kill_timer.stop()
        self._health_in_flight = False
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.deleteLater()
        self.outcome = outcome
        self._emit_line(f"strata-desktop: the engine {outcome.describe()}")
        self._remove_pid_file()
        self._set_url(None)
        self.client.set_target(None)
        uptime = time.time() - (self.started_at or time.time())
        self._set_state(EngineState.STOPPED if outcome.requested else EngineState.CRASHED)
        self.ended.emit(outcome)  # may close this (the app quitting): then nothing starts again
        if self._closed:
            return
        if self._restart_after_stop:
            self._restart_after_stop = False
            config, self._next_config = self._next_config, None
            assert config is not None
            self.start(config)
        elif outcome.config_error:
            self._emit_line("strata-desktop: not restarting: the same settings would fail the same way")
        elif not outcome.requested and self.auto_restart and self.config is not None:
            if uptime > 60:
                self._backoff_s = 1.0  # it ran a good while: this is a new failure, not a loop
            delay = self._backoff_s
            self._backoff_s = min(self._backoff_s * 2, 60.0)
            self._emit_line(f"strata-desktop: restarting in {delay:g} s")
            self.restart_scheduled.emit(delay)
            self._auto_timer.start(int(delay * 1000))

    def _auto_restart(self) -> None:
        if not self.running and self.state is EngineState.CRASHED and self.config is not None:
            self.start(self.config)

    def cancel_auto_restart(self) -> None:
        self._auto_timer.stop()

    def cancel_restarts(self) -> None:
        """No engine starts again: neither the back-off's nor a restart's waiting for the old one to stop (the
        app is quitting: an engine started then would outlive it, unrecorded)."""
        self.cancel_auto_restart()
        self._restart_after_stop = False
        self._next_config = None

    def close(self) -> None:
        """At exit, after the engine ended: finish pending pid-file work; nothing starts after this."""
        self._closed = True
        self.cancel_restarts()
        self._files.shutdown(wait=True)
