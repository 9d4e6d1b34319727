"""Probe 5, a full and read-only cache folder: disk storage on a small tmpfs that fills up, then on a folder nothing
may change; the engine keeps answering (no 5xx), and GET /metrics reports the disk error (its JSON
`conversation_cache.disk_error` and the `strata_disk_error` gauge) until a write succeeds again. Root only (it
mounts a tmpfs): otherwise a SKIP line says why."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from tools.reliability.common import Checks, Options, Result
from tools.reliability.engine import Engine

NAME = "full-read-only-folder"
# One short conversation of the bundled model parks ~2 MiB of K/V: room for a few, so the first parks succeed.
DISK_MIB = 8
T = TypeVar("T")
GAUGE = re.compile(r'^strata_disk_error\{reason="(.*)"\} ([0-9.e+-]+)$', re.MULTILINE)


def run(options: Options) -> Result:
    why = cannot_mount()
    if why:
        return Result(NAME, "SKIP", why)
    checks = Checks(NAME)
    folder = options.folder("small-disk")
    with small_tmpfs(folder, DISK_MIB) as error:
        if error:
            return Result(NAME, "SKIP", f"cannot mount a {DISK_MIB} MiB tmpfs: {error}")
        engine = Engine.start(["--model", "", "--ctx-size", "512", "--parallel", "1",
                               "--conversation-cache-storage", "disk", "--conversation-cache-dir", folder,
                               "--conversation-cache-min-free-mib", "0", *options.engine_args],
                              options.folder("logs") + f"/{NAME}.log", cwd=options.workdir)
        try:
            statuses = scenario(checks, engine, folder)
            checks.note("statuses " + " ".join(f"{s}x{statuses.count(s)}" for s in sorted(set(statuses))))
            checks.expect(all(0 < s < 500 for s in statuses), "a request got a 5xx or no answer")
            checks.expect(engine.healthy(), "the engine is not healthy afterwards")
        finally:
            engine.terminate()
    return checks.result()


def cannot_mount() -> str:
    if os.name != "posix" or os.geteuid() != 0:
        return "needs root to mount a small tmpfs (run the battery as root for this probe)"
    missing = [tool for tool in ("mount", "umount", "chattr") if not shutil.which(tool)]
    return f"needs {', '.join(missing)}" if missing else ""


@contextlib.contextmanager
def small_tmpfs(folder: str, size_mib: int) -> Iterator[str]:
    """Mounts a tmpfs of `size_mib` on `folder`; yields "" or why it could not."""
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", folder],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        yield mounted.stderr.strip() or f"mount exited with {mounted.returncode}"
        return
    try:
        yield ""
    finally:
        subprocess.run(["umount", "-l", folder], check=False)


def scenario(checks: Checks, engine: Engine, folder: str) -> list[int]:
    statuses: list[int] = []

    def ask(topic: str) -> None:  # ~60 tokens: long enough to be parked when the next one takes the slot
        prompt = f"{topic}: " + "The quick brown fox jumps over the lazy dog. " * 6
        statuses.append(engine.post("/v1/completions", json.dumps({"prompt": prompt, "max_tokens": 2}).encode()).status)

    ask("A")
    checks.expect(disk_error(engine) == ("", 0.0), f"a disk error before any: {disk_error(engine)}")
    filler = fill(folder)
    ask("B")  # parks A: no space left
    full = until(lambda: disk_error(engine)[0])
    checks.note(f"full: {full[:60]!r}")
    checks.expect(full.startswith("ENOSPC") and disk_error(engine)[1] == 1.0, "a full disk is not in /metrics")
    os.unlink(filler)
    ask("C")  # parks B: written, which clears the error
    checks.expect(until(lambda: disk_error(engine)[0] == "") is True, "the error stayed after a write succeeded")
    cache_folder = figures(engine)["dir"]
    immutable(cache_folder, True)  # a read-only remount is refused while the engine holds its lock file open
    try:
        ask("D")  # parks C: nothing in the folder may change
        read_only = until(lambda: disk_error(engine)[0])
        checks.note(f"read-only: {read_only[:60]!r}")
        checks.expect(read_only.startswith("EPERM") and disk_error(engine)[1] == 1.0,
                      "a folder that may not change is not in /metrics")
        statuses.append(engine.post("/cache/purge", b'{"tier": "disk"}').status)
        statuses.append(engine.get("/cache/conversations").status)
        ask("E")
    finally:
        immutable(cache_folder, False)
    return statuses


def figures(engine: Engine) -> dict:
    metrics = engine.get("/metrics").json()
    assert isinstance(metrics, dict)
    return metrics["conversation_cache"]


def disk_error(engine: Engine) -> tuple[str, float]:
    """The JSON's disk_error, and the Prometheus gauge's value (-1: no gauge)."""
    text = engine.get("/metrics?format=prometheus").body.decode()
    gauge = GAUGE.search(text)
    return figures(engine)["disk_error"], float(gauge.group(2)) if gauge else -1.0


def fill(folder: str) -> str:
    """A file that takes every free byte of the file system; returns its path."""
    path = os.path.join(folder, "filler")
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * (64 << 10))
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
    return path


def immutable(folder: str, on: bool) -> None:
    """`chattr +i`: no file in `folder` can be created, renamed or removed, by root either (chmod would not stop
    root)."""
    subprocess.run(["chattr", "+i" if on else "-i", folder], check=True)


def until(what: Callable[[], T], timeout: float = 20.0) -> T:
    deadline = time.monotonic() + timeout
    while not (value := what()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return value
