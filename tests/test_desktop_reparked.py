"""A conversation restored from its disk copy and parked again (tiered mode) is one row in the Monitor, not a new
row (hits 0) beside its disk row: the engine parks it under a new id and lists both, the Monitor ties them
together from the event log. The app runs the real engine on the bundled model.
"""

from __future__ import annotations

import os

os.environ["QT_QPA_PLATFORM"] = "offscreen"

import httpx
import pytest

from desktop.engine_process import EngineState
from desktop.main_window import MainWindow
from desktop.monitor.conversations import ParkedConversation
from desktop.settings import Paths
from tests.test_desktop_chat import LOAD_TIMEOUT_S, pump_until

pytestmark = pytest.mark.timeout(240)
APPLES = "Tell me about apples in orchards. " * 20
RIVERS = "Tell me about rivers and bridges. " * 20


def turn(w: MainWindow, messages: list[dict[str, str]], text: str) -> dict:
    # Greedy: a sampled answer sent back may tokenize otherwise than it was generated, and a restore of only part of
    # the disk copy is a branch (desktop.monitor.lineage), which would make this a different test.
    messages.append({"role": "user", "content": text})
    body = httpx.post(w.engine.url + "/v1/chat/completions", timeout=60, trust_env=False,
                      json={"model": "x", "messages": messages, "max_tokens": 5, "temperature": 0}).json()
    messages.append(body["choices"][0]["message"])
    return body["usage"]


def named(w: MainWindow, words: str) -> list[ParkedConversation]:
    return [r for r in w.monitor.model.rows if r.name.startswith(words)]


def test_a_conversation_restored_from_disk_and_parked_again_is_one_row(qtbot, qapp, tmp_path):
    w = MainWindow(Paths(tmp_path / "cfg", tmp_path / "state"), use_tray=False, environ={})
    w.store.set("port", 0)
    w.store.set("parallel", 1)  # one slot: each conversation parks the other
    w.store.set("conversation_cache_storage", "tiered")
    w.store.set("conversation_cache_dir", str(tmp_path / "parked"))
    w.show()  # the Monitor is the shown tab: the event log is fetched
    w.start()
    try:
        assert pump_until(lambda: w.engine.state is EngineState.READY, LOAD_TIMEOUT_S), "\n".join(w.engine.lines)
        apples: list[dict[str, str]] = []
        rivers: list[dict[str, str]] = []
        for n in range(3):
            turn(w, apples, APPLES if n == 0 else f"And more, {n}?")
            turn(w, rivers, RIVERS if n == 0 else f"And more, {n}?")
        pid = w.engine.pid
        w.restart_engine()  # a clean stop spills both to disk
        assert pump_until(lambda: w.engine.state is EngineState.READY and w.engine.pid != pid, LOAD_TIMEOUT_S)
        # the new engine's list: until its first poll the Monitor may still show the old one's RAM row
        on_disk_only = lambda: [r.tiers for r in named(w, "Tell me about apples")] == [("disk",)]  # noqa: E731
        assert pump_until(on_disk_only, 30), named(w, "Tell me about apples")
        on_disk = named(w, "Tell me about apples")[0]
        assert on_disk.hits >= 2, on_disk

        usage = turn(w, apples, "And pears?")  # restored from its disk copy...
        assert usage["prompt_tokens_details"]["cached_tokens"] >= on_disk.tokens
        turn(w, rivers, "And canals?")  # ...and parked again in RAM, under a new id

        def one_row() -> bool:
            rows = named(w, "Tell me about apples")
            return len(rows) == 1 and rows[0].tiers == ("ram", "disk")

        ok = pump_until(one_row, 20)
        rows = named(w, "Tell me about apples")
        assert ok, rows
        row = rows[0]
        assert on_disk.id in row.ids and row.id != on_disk.id, "the live id, and the disk copy's"
        assert row.hits >= on_disk.hits and row.tokens > on_disk.tokens, row
        shown = [w.monitor.model.index(r, 0).data() for r in range(w.monitor.model.rowCount())]
        assert sum(s.startswith("Tell me about apples") for s in shown) == 1, shown
        assert len([r for r in w.conversations if r.name.startswith("Tell me about apples")]) == 1, \
            "purge and the tray count it once too"
    finally:
        w.shutdown_now()
