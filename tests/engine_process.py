"""Start a real `strata serve` subprocess for a test, wait until it serves, stop it, keep its log.

    with engine_process("--model", "", "--parallel", "1") as engine:
        client = openai.OpenAI(base_url=engine.base_url + "/v1", api_key="none")

The engine listens on a free port (`--port 0`); its log (stdout and stderr together) goes to a file whose text is
in `engine.logs()`, and is printed when start-up fails so the failure explains itself. Its stdin is a pipe this
side holds: an engine whose test process died stops by itself.

`stop()` is the engine's own clean stop on every platform, never `terminate()`: on Windows that is
TerminateProcess, a crash that skips parking the live slots and spilling the tiered cache.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LISTENING = re.compile(r"strata: listening on (http://\S+)")


class EngineStartError(RuntimeError):
    """The engine exited or did not become healthy in time; the message carries its log."""


@dataclass
class EngineProcess:
    """A running `strata serve`: its process, base URL (no trailing slash), and log file."""

    proc: subprocess.Popen
    log_path: str
    base_url: str = ""
    api_key: str | None = None
    args: list[str] = field(default_factory=list)

    def logs(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def get_status(self, path: str) -> int:
        """HTTP status of GET `path` (0 when nothing answers)."""
        return self.get_json(path)[0]

    def get_json(self, path: str) -> tuple[int, object]:
        """(HTTP status, decoded JSON body or None) of GET `path`; (0, None) when nothing answers."""
        request = urllib.request.Request(self.base_url + path, headers=self.headers())
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                return response.status, _json(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, _json(exc.read())
        except OSError:
            return 0, None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 60.0) -> int:
        """Stop cleanly (`ask_to_stop`), wait for the engine's own exit, and kill it only if it has not exited
        within `timeout`; returns the exit status."""
        if self.proc.poll() is None:
            self.ask_to_stop()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode

    def ask_to_stop(self) -> None:
        """POST /shutdown (once it listens), then close its stdin: either one starts the engine's clean shutdown,
        and the second still reaches an engine that is loading, not yet listening, or stopping already."""
        if self.base_url:
            request = urllib.request.Request(self.base_url + "/shutdown", method="POST", headers=self.headers())
            with contextlib.suppress(OSError), urllib.request.urlopen(request, timeout=5):
                pass
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()


def start_engine(*args: str, api_key: str | None = None, timeout: float = 120.0, env: dict[str, str] | None = None,
                 log_dir: str | None = None, cwd: str = REPO,
                 health_log: list[tuple[int, object]] | None = None) -> EngineProcess:
    """Start `python -m engine serve --port 0 ARGS...` and return once GET /health answers 200.

    `api_key` is passed as --api-key and used for the health check. Its stdin is a pipe (`engine.proc.stdin`) a
    test may close (the engine shuts down when it does). `cwd` is the engine's working folder (the repository is
    put on PYTHONPATH, so it imports the same code from anywhere). `health_log` receives every answer of
    GET /health (status, body) while it waits, polled often, to follow the start-up phases.
    """
    argv = [sys.executable, "-m", "engine", "serve", "--port", "0", *args]
    if api_key is not None:
        argv += ["--api-key", api_key]
    fd, log_path = tempfile.mkstemp(prefix="strata-engine-", suffix=".log", dir=log_dir)
    with os.fdopen(fd, "wb") as log:
        proc = subprocess.Popen(
            argv, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1",
                 "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p), **(env or {})},
        )
    engine = EngineProcess(proc, log_path, api_key=api_key, args=list(args))
    deadline = time.monotonic() + timeout
    try:
        while not engine.base_url:
            match = LISTENING.search(engine.logs())
            if match:
                engine.base_url = match.group(1).rstrip("/")
                break
            _check_running(engine, deadline, "print its address")
            time.sleep(0.05)
        while True:
            answer = engine.get_json("/health")
            if health_log is not None and answer[0]:
                health_log.append(answer)
            if answer[0] == 200:
                break
            _check_running(engine, deadline, "report healthy")
            time.sleep(0.01 if health_log is not None else 0.1)
    except BaseException:
        engine.stop(timeout=10)
        raise
    return engine


def _json(data: bytes) -> object:
    try:
        return json.loads(data)
    except ValueError:
        return None


def _check_running(engine: EngineProcess, deadline: float, what: str) -> None:
    if engine.proc.poll() is not None:
        raise EngineStartError(f"strata serve {' '.join(engine.args)} exited with status {engine.proc.returncode} "
                               f"before it could {what}; its log:\n{engine.logs()}")
    if time.monotonic() > deadline:
        raise EngineStartError(f"strata serve {' '.join(engine.args)} did not {what} in time; its log:\n"
                               f"{engine.logs()}")


@contextlib.contextmanager
def engine_process(*args: str, **kwargs) -> Iterator[EngineProcess]:
    """`start_engine` as a context manager: the engine is stopped (and its log file removed) on exit."""
    engine = start_engine(*args, **kwargs)
    try:
        yield engine
    except BaseException:
        print(f"--- strata serve log ---\n{engine.logs()}", file=sys.stderr)
        raise
    finally:
        engine.stop()
        with contextlib.suppress(OSError):
            os.remove(engine.log_path)
