"""A `strata serve` child for a probe, and the outside measurements of it: HTTP requests, peak RSS, CPU time."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LISTENING = re.compile(r"strata: listening on (http://\S+)")
START_S = 180.0  # a cold start converts the bundled model's weights once (seconds); a warm one takes ~4 s


class EngineError(RuntimeError):
    """The engine exited, or did not become healthy in time; the message ends with its log."""


@dataclass
class Reply:
    status: int  # 0: no answer (refused, reset, timed out)
    body: bytes
    headers: dict[str, str]

    def json(self) -> object:
        return json.loads(self.body)


def request(base_url: str, method: str, path: str, body: bytes | None = None,
            headers: dict[str, str | None] | None = None, timeout: float = 60.0) -> Reply:
    """One HTTP request on a fresh connection; a JSON content type unless `headers` names one (None: no header)."""
    url = urlsplit(base_url)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=timeout)
    given = {"Content-Type": "application/json", **(headers or {})}
    try:
        conn.putrequest(method, path, skip_host="Host" in given, skip_accept_encoding=True)
        for name, value in given.items():
            if value is not None:
                conn.putheader(name, value)
        conn.putheader("Content-Length", str(len(body or b"")))
        conn.endheaders(body or b"")
        response = conn.getresponse()
        return Reply(response.status, response.read(), {k.lower(): v for k, v in response.getheaders()})
    except (OSError, http.client.HTTPException):
        return Reply(0, b"", {})
    finally:
        conn.close()


class Engine:
    """`python -m engine serve --port 0 ARGS`, its log in `log_path`; started by `Engine.start`."""

    def __init__(self, args: list[str], log_path: str, cwd: str) -> None:
        self.args = args
        self.log_path = log_path
        self.log_start = os.path.getsize(log_path) if os.path.exists(log_path) else 0  # a restart appends
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)}
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--port", "0", *args], cwd=cwd,
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        self.ps = psutil.Process(self.proc.pid)
        self.base_url = ""

    @classmethod
    def start(cls, args: list[str], log_path: str, cwd: str, timeout: float = START_S) -> Engine:
        engine = cls(args, log_path, cwd)
        try:
            engine.wait_healthy(timeout)
        except BaseException:
            engine.kill()
            raise
        return engine

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if not self.base_url and (match := LISTENING.search(self.logs())):
                self.base_url = match.group(1).rstrip("/")
            if self.base_url and self.get("/health", timeout=5).status == 200:
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                why = f"exited with status {self.proc.returncode}" if self.proc.poll() is not None else "timed out"
                raise EngineError(f"strata serve {' '.join(self.args)}: {why} before it was healthy; its log "
                                  f"({self.log_path}) ends:\n{self.logs()[-3000:]}")
            time.sleep(0.1)

    def logs(self) -> str:
        """This engine's log (a restart's log follows its predecessor's in the same file)."""
        with open(self.log_path, "rb") as f:
            f.seek(self.log_start)
            return f.read().decode("utf-8", errors="replace")

    def get(self, path: str, timeout: float = 30.0) -> Reply:
        return request(self.base_url, "GET", path, headers={"Content-Type": None}, timeout=timeout)

    def post(self, path: str, body: bytes, timeout: float = 120.0,
             headers: dict[str, str | None] | None = None) -> Reply:
        return request(self.base_url, "POST", path, body, headers=headers, timeout=timeout)

    def healthy(self) -> bool:
        return self.proc.poll() is None and self.get("/health", timeout=10).status == 200

    def rss(self) -> int:
        return self.ps.memory_info().rss

    def cpu_s(self) -> float:
        times = self.ps.cpu_times()
        return times.user + times.system

    def terminate(self, timeout: float = 60.0) -> float:
        """SIGTERM; the seconds until the process exited (SIGKILL after `timeout`: then the result is > timeout)."""
        started = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return time.monotonic() - started

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


class PeakRss:
    """The highest RSS of a process while the `with` block runs: VmHWM, reset on entry where Linux lets us
    (/proc/PID/clear_refs), and a sample every 20 ms besides (which also covers systems without it)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.ps = psutil.Process(pid)
        self.before = self.peak = 0
        self.exact = False
        self._done = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> PeakRss:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> PeakRss:
        self.before = self.peak = self.ps.memory_info().rss
        self.exact = _reset_high_water_mark(self.pid)
        self._sampler.start()
        return self

    def stop(self) -> None:
        self._done.set()
        self._sampler.join()
        if self.exact:
            self.peak = max(self.peak, _high_water_mark(self.pid))

    @property
    def growth(self) -> int:
        return self.peak - self.before

    def _sample(self) -> None:
        while not self._done.is_set():
            try:
                self.peak = max(self.peak, self.ps.memory_info().rss)
            except psutil.Error:
                return
            self._done.wait(0.02)


def _reset_high_water_mark(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return _high_water_mark(pid) > 0
    except OSError:
        return False


def _high_water_mark(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def seconds_until_quiet(engine: Engine, limit: float, cpu_share: float, window: float = 0.5) -> float:
    """Seconds until the engine's CPU time grows by less than `cpu_share` of a core over `window` s; a value over
    `limit` when it is still busy then."""
    started = time.monotonic()
    last = engine.cpu_s()
    while True:
        time.sleep(window)
        now = engine.cpu_s()
        if now - last < cpu_share * window:
            return time.monotonic() - started - window
        last = now
        if time.monotonic() - started > limit + window:
            return time.monotonic() - started
