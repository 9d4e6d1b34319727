"""A crash report says what the conversation cache lost (RAM) and kept (disk): the real engine, parked
conversations, SIGKILL, in ram, disk and tiered storage; and the disk-kept conversation is back after the restart."""

from __future__ import annotations

import os

os.environ["QT_QPA_PLATFORM"] = "offscreen"

import signal

import pytest

from desktop.crash_report import cache_loss
from desktop.engine_process import EngineState
from desktop.main_window import MainWindow
from desktop.settings import Paths
from tests.test_desktop_support import conversation_row

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(300)
LOAD_TIMEOUT_MS = 120_000
SYSTEM = "You are a careful assistant who answers questions about {} in one short sentence. "


def conversation(topic: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM.format(topic) * 12}, {"role": "user", "content": f"Tell me of {topic}."}]


def test_loss_counts_a_conversation_once_and_a_written_copy_as_kept():
    rows = [
        conversation_row("a", "ram", bytes=1 << 20),
        conversation_row("b", "ram", bytes=2 << 20),
        conversation_row("b", "disk", bytes=2 << 20, on_disk=True),  # tiered: in RAM and written
        conversation_row("c", "disk", bytes=4 << 20, pending=True),  # not written yet: gone with the process
        conversation_row("d", "disk", bytes=3 << 20, on_disk=True),
    ]
    loss = cache_loss(rows, age_s=0.4)
    assert (loss.lost, loss.lost_bytes, loss.kept, loss.kept_bytes) == (2, 5 << 20, 2, 5 << 20)
    said = loss.describe()
    assert said.startswith("Lost: 2 parked conversations held in RAM or not yet written (5.0 MiB). Kept: 2 parked "
                           "conversations on disk (5.0 MiB), restored when the engine starts again. "), said
    assert "each conversation's own, added up" in said and "stored once" in said, "says how the sizes add up"
    assert "added up" not in cache_loss(rows[:1], 0).describe(), "one conversation: nothing to add up"
    assert cache_loss([], 7).describe() == ("No parked conversations were lost: none were parked (as last "
                                            "reported 7 s before the engine ended).")
    assert cache_loss(rows[:1], 0).describe().endswith("Kept: none on disk.")


@pytest.mark.slow
@pytest.mark.parametrize(("storage", "settings", "topics", "lost", "kept"), [
    ("ram", {}, 2, 1, 0),  # the second conversation parks the first in RAM: gone with the process
    ("disk", {}, 2, 0, 1),  # parked in a file: kept, and back after the restart
    # RAM holds one conversation: the third parks the second, which pushes the first to disk (kept).
    ("tiered", {"conversation_cache_mib": 16}, 3, 1, 1),
], ids=["ram", "disk", "tiered"])
def test_a_killed_engine_reports_what_was_lost_and_kept(qtbot, tmp_path, storage, settings, topics, lost, kept):
    w = MainWindow(Paths(tmp_path / "cfg", tmp_path / "state"), use_tray=False, environ={})
    qtbot.addWidget(w)
    for name, value in {"port": 0, "conversation_cache_storage": storage,
                        "conversation_cache_dir": str(tmp_path / "parked"), **settings}.items():
        w.store.set(name, value)
    try:
        w.show()
        w.start()  # the poller, then the engine (the default preference)
        qtbot.waitUntil(lambda: w.engine.state is EngineState.READY, timeout=LOAD_TIMEOUT_MS)
        client = openai.OpenAI(base_url=w.engine.url + "/v1", api_key="unused", timeout=120)
        for topic in ("rivers", "bridges", "violins")[:topics]:  # one slot: each parks the one before
            client.chat.completions.create(model="default", messages=conversation(topic), max_tokens=2,
                                           temperature=0)

        def snapshot() -> tuple[int, int]:
            loss = cache_loss(w.conversation_rows or [], 0)
            return loss.lost, loss.kept

        # The app's own snapshot (the poller) shows them parked, and written where they go to disk.
        qtbot.waitUntil(lambda: snapshot() == (lost, kept), timeout=30000)
        on_disk = {r.id for r in w.conversation_rows if r.on_disk}
        w.engine.auto_restart = False
        os.kill(w.engine.pid, signal.SIGKILL)
        qtbot.waitUntil(lambda: not w.crash_panel.isHidden(), timeout=10000)
        assert "killed by SIGKILL" in w.crash_text.text()
        said = w.crash_panel.cache_text.text()
        assert w.crash_panel.cache_text.isVisible()
        assert said.startswith(f"Lost: {lost} parked conversation" if lost else "Lost: none."), said
        assert (f"Kept: {kept} parked conversation on disk" if kept else "Kept: none on disk") in said, said
        if storage == "disk":
            w.crash_restart.click()
            qtbot.waitUntil(lambda: w.engine.state is EngineState.READY, timeout=LOAD_TIMEOUT_MS)
            qtbot.waitUntil(lambda: on_disk <= {r.id for r in w.conversation_rows or []}, timeout=30000)
            assert w.crash_panel.isHidden()
    finally:
        w.shutdown_now()


def test_a_kill_when_memory_ran_out_says_so_and_a_status_names_its_last_line():
    import time

    from desktop.client import MemorySample
    from desktop.crash_report import memory_note
    from desktop.engine_process import ProcessOutcome

    killed = ProcessOutcome(int(signal.SIGKILL), True, False)
    gib = 1 << 30
    low = MemorySample(time.time(), engine_rss=7 * gib, host_available=100 << 20, host_total=8 * gib)
    plenty = MemorySample(time.time(), engine_rss=gib, host_available=4 * gib, host_total=8 * gib)
    note = memory_note(killed, low)
    assert note.startswith("The system was nearly out of memory (100.0 MiB of 8.0 GiB free at the last sample, "
                           "the engine using 7.0 GiB): most likely its out-of-memory killer")
    assert memory_note(killed, plenty) == "" and memory_note(killed, None) == ""
    assert memory_note(ProcessOutcome(int(signal.SIGKILL), True, True), low) == "", "a kill the app asked for"
    assert memory_note(ProcessOutcome(1, False, False), low) == ""
    died = ProcessOutcome(1, False, False, last_line="RuntimeError: CUDA error: device-side assert triggered")
    assert died.describe() == "exited with status 1: RuntimeError: CUDA error: device-side assert triggered"
