"""The engine's pid file: which engine this app started (pid, start time, URL, command, and the app's own pid),
written atomically, so that an engine orphaned by a crash of the app is found and stopped at the next launch
(`reap_orphan`). A recorded pid counts only while its process start time matches: pids are reused.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import psutil

from desktop.client import EngineClient
from desktop.files import atomic_write


def process_create_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def write_pid_file(path: Path, pid: int, url: str | None, command: list[str]) -> None:
    record = {
        "pid": pid,
        "create_time": process_create_time(pid),
        "app_pid": os.getpid(),
        "app_create_time": process_create_time(os.getpid()),
        "url": url,
        "command": command,
    }
    atomic_write(path, json.dumps(record, indent=1) + "\n")


def read_pid_file(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("pid"), int) else None


def _same_process(pid: Any, create_time: Any) -> psutil.Process | None:
    """The live process `pid` if it is the one that was recorded (pids are reused)."""
    if not isinstance(pid, int) or pid <= 0:
        return None
    try:
        p = psutil.Process(pid)
        if create_time is not None and abs(p.create_time() - float(create_time)) > 1.0:
            return None
        if p.status() == psutil.STATUS_ZOMBIE:
            return None
        return p
    except (psutil.NoSuchProcess, psutil.AccessDenied, TypeError, ValueError):
        return None


def reap_orphan(path: Path, client: EngineClient | None = None, grace_s: float = 30.0,
                api_key: str | None = None) -> str | None:
    """Stop an engine left running by an app that is gone, then remove the pid file. Blocking: run off the GUI thread.

    `api_key`: the settings' key, which an engine started with one needs on /shutdown (one that refuses it still
    stops when its stdin closes, as it did with its app, or is killed after `grace_s`).

    Returns what was done, for the user, or None when there was nothing to do.
    """
    record = read_pid_file(path)
    if record is None:
        with contextlib.suppress(OSError):
            path.unlink()
        return None
    app = _same_process(record.get("app_pid"), record.get("app_create_time"))
    if app is not None and app.pid != os.getpid():
        return None  # its app is alive: not an orphan
    engine = _same_process(record.get("pid"), record.get("create_time"))
    message = None
    if engine is not None:
        url = record.get("url")
        if client is not None and url:
            client.call("POST", str(url).rstrip("/") + "/shutdown", api_key=api_key, timeout=2.0)
        _wait_then_kill(engine, grace_s)
        message = f"Stopped an engine (pid {engine.pid}) left running by an earlier session of the app."
    with contextlib.suppress(OSError):
        path.unlink()
    return message


def _wait_then_kill(engine: psutil.Process, grace_s: float) -> None:
    """Wait for the engine's own clean exit, which POST /shutdown or its stdin began (the pipe closed when its app
    died), so that it parks and spills its cache; kill it only after `grace_s`. No terminate() in between: on
    Windows that is TerminateProcess, the same crash as a kill."""
    try:
        engine.wait(timeout=grace_s)
        return
    except psutil.TimeoutExpired:
        pass
    except psutil.NoSuchProcess:
        return
    with contextlib.suppress(psutil.NoSuchProcess):
        engine.kill()
    with contextlib.suppress(psutil.Error):
        engine.wait(timeout=5)
