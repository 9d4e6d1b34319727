"""A live engine's disk tier on a disk that fills up, then on a folder nothing may change: GET /metrics says so (the
errno's name and when) until a write succeeds again, and a purge that cannot remove files names them without the
folder's path.

The folder is a small tmpfs mounted for the test, made unchangeable with `chattr +i` (which stops root too, where
permissions would not): root only, skipped otherwise. The in-process tests in test_cache_writer.py and
test_cache_reports.py cover the same without mounting."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.engine_process import engine_process
from tests.model_fixtures import write_tiny_model

STAMP = re.compile(r"failed at \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")
TEXT = "The quick brown fox jumps over the lazy dog. " * 6


@contextlib.contextmanager
def small_tmpfs(folder: str, mib: int) -> Iterator[str]:
    os.makedirs(folder, exist_ok=True)
    if not (shutil.which("mount") and shutil.which("chattr")):
        pytest.skip("needs mount and chattr to make a small disk and a folder nothing may change")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", folder],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill up: {mounted.stderr.strip() or mounted.returncode}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", folder], check=False)


def fill(folder: str) -> str:
    """Write a file until the file system is full; returns its path."""
    path = os.path.join(folder, "filler")
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * (64 << 10))
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    return path


def immutable(folder: str, on: bool) -> None:
    """`chattr +i`: no file in `folder` can be created, renamed or removed, by root either. (Remounting the tmpfs
    read-only is refused while the engine holds its lock file open for writing.)"""
    subprocess.run(["chattr", "+i" if on else "-i", folder], check=True)


def cache_figures(http: httpx.Client) -> dict:
    return http.get("/metrics").json()["conversation_cache"]


def disk_error_gauge(http: httpx.Client) -> tuple[float, str]:
    text = http.get("/metrics", params={"format": "prometheus"}).text
    [sample] = [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == "strata_disk_error"]
    return sample.value, sample.labels["reason"]


def until(what, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while not (value := what()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def test_a_full_then_read_only_disk_shows_in_metrics_until_a_write_succeeds(tmp_path):
    model = write_tiny_model(tmp_path, "llama")
    with small_tmpfs(str(tmp_path / "parked"), 4) as folder, engine_process(
        "--model", model, "--ctx-size", "512", "--parallel", "1", "--conversation-cache-storage", "disk",
        "--conversation-cache-dir", folder, "--conversation-cache-min-free-mib", "0",
    ) as engine, httpx.Client(base_url=engine.base_url, timeout=60) as http:

        def ask(topic: str) -> None:
            r = http.post("/v1/completions", json={"prompt": f"{topic}: {TEXT}", "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200, r.text

        ask("A")
        assert cache_figures(http)["disk_error"] == "" and disk_error_gauge(http) == (0.0, "")
        filler = fill(folder)
        ask("B")  # parks A: its write finds no space
        error = until(lambda: cache_figures(http)["disk_error"])  # as soon as the writer reports
        assert error.startswith("ENOSPC (No space left on device): writing conversation ") and STAMP.search(error)
        assert disk_error_gauge(http) == (1.0, error)

        os.unlink(filler)
        ask("C")  # parks B: written, which clears the error
        figures = until(lambda: (c := cache_figures(http))["spills"] == 1 and c)
        assert figures["disk_error"] == "" and disk_error_gauge(http) == (0.0, "")
        [parked] = http.get("/cache/conversations").json()["conversations"]

        cache_folder = cache_figures(http)["dir"]  # the model's own folder inside the one given
        immutable(cache_folder, True)
        try:
            ask("D")  # parks C: nothing in the folder can change now
            error = until(lambda: cache_figures(http)["disk_error"])
            assert error.startswith("EPERM (Operation not permitted): writing conversation ") and STAMP.search(error)
            purged = http.post("/cache/purge", json={"tier": "disk"}).json()
            [skipped] = purged["skipped"]
            assert skipped["id"] == parked["id"]
            assert f"conv-{parked['id']}.safetensors" in skipped["reason"] and folder not in skipped["reason"]
            assert "Operation not permitted" in skipped["reason"]
        finally:
            immutable(cache_folder, False)
