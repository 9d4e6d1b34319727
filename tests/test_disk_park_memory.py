"""A disk park holds no RAM once written: the parked copy is staged, written, and its memory given back, so the
engine's resident memory does not grow with each conversation parked on disk (the seed's point of `disk` storage:
RSS before and after a park, several parks in a row)."""

from __future__ import annotations

import time

import openai

from tests.engine_process import engine_process

LONG = "The keepers of the northern lighthouses wrote down every ship, storm and lamp they tended. " * 120


def _rss_anon_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no RssAnon in /proc/PID/status")


def _written(engine) -> dict:
    deadline = time.monotonic() + 60
    while True:
        cache = engine.get_json("/metrics")[1]["conversation_cache"]
        if cache["bytes_pending"] == 0 or time.monotonic() > deadline:
            return cache
        time.sleep(0.1)


def test_disk_parks_do_not_grow_the_engines_memory(tmp_path):
    flags = ("--model", "", "--parallel", "1", "--conversation-cache-storage", "disk",
             "--conversation-cache-dir", str(tmp_path))
    with engine_process(*flags) as engine:
        client = openai.OpenAI(base_url=engine.base_url + "/v1", api_key="none", max_retries=0, timeout=120)
        pid = engine.proc.pid
        rows = []
        for i in range(3):
            client.chat.completions.create(model="m", max_tokens=1, messages=[{"role": "user", "content": f"{i} {LONG}"}])
            served = _rss_anon_mib(pid)
            # The next conversation takes the only slot: the long one is parked on disk.
            client.chat.completions.create(model="m", max_tokens=1, messages=[{"role": "user", "content": f"hi {i}"}])
            cache = _written(engine)
            time.sleep(0.5)
            rows.append((served, _rss_anon_mib(pid), cache["bytes_disk"] / (1 << 20)))
    parked_mib = rows[-1][2] / len(rows)  # one conversation's files
    assert parked_mib > 50, rows  # ~2K tokens of K/V: a park worth measuring
    for served, parked, _ in rows:
        assert parked - served < 0.25 * parked_mib, f"a disk park stayed in RAM: {rows}"
    assert rows[-1][1] - rows[0][1] < 0.25 * parked_mib, f"RSS grew with the conversations parked: {rows}"
