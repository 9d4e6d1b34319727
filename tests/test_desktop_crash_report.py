"""A crash report says what the conversation cache lost (RAM) and kept (disk): the real engine, parked
conversations, SIGKILL, in ram and in disk storage; and the disk-kept conversation is back after the restart."""

from __future__ import annotations

import os

os.environ["QT_QPA_PLATFORM"] = "offscreen"

import signal

import pytest

from desktop.crash_report import cache_loss
from desktop.engine_process import EngineState
from desktop.main_window import MainWindow
from desktop.settings import Paths

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(300)
LOAD_TIMEOUT_MS = 120_000
SYSTEM = "You are a careful assistant who answers questions about {} in one short sentence. "


def conversation(topic: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM.format(topic) * 12}, {"role": "user", "content": f"Tell me of {topic}."}]


def test_loss_counts_a_conversation_once_and_a_written_copy_as_kept():
    rows = [
        {"id": "a", "tier": "ram", "bytes": 1 << 20},
        {"id": "b", "tier": "ram", "bytes": 2 << 20},
        {"id": "b", "tier": "disk", "bytes": 2 << 20, "on_disk": True},  # tiered: in RAM and written
        {"id": "c", "tier": "disk", "bytes": 4 << 20, "pending": True},  # not written yet: gone with the process
        {"id": "d", "tier": "disk", "bytes": 3 << 20, "on_disk": True},
    ]
    loss = cache_loss(rows, age_s=0.4)
    assert (loss.lost, loss.lost_bytes, loss.kept, loss.kept_bytes) == (2, 5 << 20, 2, 5 << 20)
    assert loss.describe() == ("Lost: 2 parked conversations held in RAM or not yet written (5.0 MiB). "
                               "Kept: 2 parked conversations on disk (5.0 MiB), restored when the engine starts "
                               "again.")
    assert cache_loss([], 7).describe() == ("No parked conversations were lost: none were parked (as last "
                                            "reported 7 s before the engine ended).")
    assert cache_loss(rows[:1], 0).describe().endswith("Kept: none on disk.")


@pytest.mark.slow
@pytest.mark.parametrize("storage", ["ram", "disk"])
def test_a_killed_engine_reports_what_was_lost_and_kept(qtbot, tmp_path, storage):
    w = MainWindow(Paths(tmp_path / "cfg", tmp_path / "state"), use_tray=False, environ={})
    qtbot.addWidget(w)
    w.store.set("port", 0)
    w.store.set("conversation_cache_storage", storage)
    w.store.set("conversation_cache_dir", str(tmp_path / "parked"))
    try:
        w.show()
        w.start()  # the poller, then the engine (the default preference)
        qtbot.waitUntil(lambda: w.engine.state is EngineState.READY, timeout=LOAD_TIMEOUT_MS)
        client = openai.OpenAI(base_url=w.engine.url + "/v1", api_key="unused", timeout=120)
        for topic in ("rivers", "bridges"):  # one slot: the second parks the first
            client.chat.completions.create(model="default", messages=conversation(topic), max_tokens=2,
                                           temperature=0)
        # The app's own snapshot (the poller) must show the parked conversation, written when on disk.
        written = (lambda r: r.get("on_disk")) if storage == "disk" else (lambda r: r.get("tier") == "ram")
        qtbot.waitUntil(lambda: any(written(r) for r in w.conversation_rows or []), timeout=30000)
        parked = {r["id"] for r in w.conversation_rows}
        w.engine.auto_restart = False
        os.kill(w.engine.pid, signal.SIGKILL)
        qtbot.waitUntil(lambda: not w.crash_panel.isHidden(), timeout=10000)
        assert "killed by SIGKILL" in w.crash_text.text()
        said = w.crash_panel.cache_text.text()
        assert w.crash_panel.cache_text.isVisible()
        if storage == "ram":
            assert said.startswith(f"Lost: {len(parked)} parked conversation") and "Kept: none on disk" in said
        else:
            assert said.startswith("Lost: none. Kept: 1 parked conversation on disk") and "restored" in said
            w.crash_restart.click()
            qtbot.waitUntil(lambda: w.engine.state is EngineState.READY, timeout=LOAD_TIMEOUT_MS)
            qtbot.waitUntil(lambda: parked <= {r["id"] for r in w.conversation_rows or []}, timeout=30000)
            assert w.crash_panel.isHidden()
    finally:
        w.shutdown_now()
