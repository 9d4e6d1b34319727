"""The Monitor's request log, a conversation's reuse history, and its priority and pin control, with real
widgets against the stand-in engine (tests/test_desktop_support.py), plus the PATCH the client sends, as a real
HTTP server receives it."""

from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

os.environ["QT_QPA_PLATFORM"] = "offscreen"

import pytest
from PySide6.QtCore import Qt

from tests.test_desktop_support import (
    conversation_row,
    fake_engine_command,
    request_record,
    stand_in_window,
    wait_ready,
)

pytestmark = pytest.mark.timeout(90)
NNBSP = "\u202f"  # the thousands separator of format_count


@pytest.fixture
def window(qtbot, tmp_path):
    yield from stand_in_window(qtbot, tmp_path)


def _started(qtbot, window):
    window.start()
    wait_ready(qtbot, window)
    monitor = window.monitor
    qtbot.waitUntil(lambda: monitor.requests.model.rowCount() == 3 and monitor.model.rowCount() == 2, timeout=10000)
    return monitor


def _cells(model, row: int) -> list[str]:
    return [model.index(row, col).data() for col in range(model.columnCount())]


def _select(qtbot, monitor, conversation_id: str) -> None:
    for r in range(monitor.proxy.rowCount()):
        source = monitor.proxy.mapToSource(monitor.proxy.index(r, 0))
        if monitor.model.rows[source.row()].id == conversation_id:
            monitor.table.selectRow(r)
            break
    qtbot.waitUntil(lambda: _selected_id(monitor) == conversation_id, timeout=2000)


def _selected_id(monitor) -> str | None:
    selected = monitor.selected_conversation()
    return None if selected is None else selected.id


def test_the_request_log_shows_each_request_explained_newest_first(qtbot, window):
    monitor = _started(qtbot, window)
    model = monitor.requests.model
    assert model.COLUMNS == ("Time", "Conversation", "Prompt", "Reused", "Source", "Reason", "TTFT", "Drafts")
    evicted, hit, cold = (_cells(model, r) for r in range(3))
    assert evicted[1:6] == ["conv-b", "800", "0 (0%)", "–", evicted[5]]
    assert evicted[5].startswith("evicted ") and evicted[5].endswith("by park (--conversation-cache-mib)")
    assert evicted[6] == "–", "no first token: no TTFT"
    assert hit[1:] == ["Fix the parser", f"1{NNBSP}200", f"1{NNBSP}000 (83%)", "RAM", "new tokens only (200)",
                       "120 ms", "30 of 40 accepted (75%)"]
    assert cold[4:] == ["–", "nothing shared (new conversation)", "900 ms", "–"], "nothing drafted"
    assert "conversation-cache-mib" in model.index(0, 5).data(Qt.ItemDataRole.ToolTipRole)
    assert "Requests" in monitor.requests.title.text() and "3" in monitor.requests.title.text()


def test_a_selected_conversation_shows_its_history_and_its_priority_changes_on_the_engine(qtbot, window):
    monitor = _started(qtbot, window)
    controls, log = monitor.controls, monitor.requests
    assert not controls.priority.isEnabled(), "nothing selected: nothing to change"
    _select(qtbot, monitor, "conv-a")
    assert log.model.rowCount() == 2 and "Requests of conv-a" in log.title.text()
    assert log.summary.text() == ("2 requests · reused 45% of their prompt tokens · TTFT median 510 ms, last 120 ms"
                                  " · drafts: 30 of 40 accepted (75%)")
    assert controls.priority.currentData() == "normal" and not controls.pinned.isChecked()

    priority_col = monitor.model.COLUMNS.index("Priority")
    controls.priority.setCurrentIndex(controls.priority.findData("high"))
    controls.priority.activated.emit(controls.priority.currentIndex())  # what a user's choice emits
    qtbot.waitUntil(lambda: "high priority" in controls.result.text(), timeout=5000)
    qtbot.waitUntil(lambda: monitor.model.index(0, priority_col).data() == "high", timeout=5000)

    controls.pinned.click()
    qtbot.waitUntil(lambda: "pinned" in controls.result.text() and "not" not in controls.result.text(), timeout=5000)
    pinned_col = monitor.model.COLUMNS.index("Pinned")
    qtbot.waitUntil(lambda: monitor.model.index(0, pinned_col).data() == "pinned", timeout=5000)
    assert _selected_id(monitor) == "conv-a", "the selection survives the refresh"

    monitor._conversation_menu(monitor.table.visualRect(monitor.table.currentIndex()).center())
    menu = monitor.conversation_menu
    actions = {a.text(): a for a in menu.actions() if a.text()}
    assert actions["High priority"].isChecked() and "Unpin" in actions
    actions["Low priority"].trigger()
    qtbot.waitUntil(lambda: monitor.model.index(0, priority_col).data() == "low", timeout=5000)

    log.show_all.click()
    assert log.model.rowCount() == 3 and monitor.selected_conversation() is None


def test_a_conversation_is_dropped_from_its_row_after_the_question(qtbot, window):
    from PySide6.QtWidgets import QMessageBox

    monitor = _started(qtbot, window)
    _select(qtbot, monitor, "conv-b")
    monitor.controls.drop.click()
    qtbot.waitUntil(lambda: window.findChild(QMessageBox) is not None, timeout=5000)
    box = window.findChild(QMessageBox)
    assert "Drop" in box.text() and box.defaultButton() is box.button(QMessageBox.StandardButton.Cancel)
    box.button(QMessageBox.StandardButton.Yes).click()
    qtbot.waitUntil(lambda: "Dropped" in monitor.controls.result.text(), timeout=5000)
    qtbot.waitUntil(lambda: all(r.id != "conv-b" for r in monitor.model.rows), timeout=5000)
    assert any(r.id == "conv-a" for r in monitor.model.rows), "only the chosen one goes"


def test_an_engine_without_the_route_is_said_in_its_own_words(qtbot, window):
    window.engine.command_for = fake_engine_command("--no-patch")
    monitor = _started(qtbot, window)
    _select(qtbot, monitor, "conv-b")
    monitor.controls.pinned.click()
    result = monitor.controls.result
    qtbot.waitUntil(lambda: "cannot change" in result.text(), timeout=5000)
    assert "no route PATCH /cache/conversations/conv-b" in result.text(), "the engine's own message"
    assert "#a00000" in result.styleSheet(), "shown as an error"


class _Recorder(BaseHTTPRequestHandler):
    seen: list[dict] = []

    def log_message(self, fmt, *args) -> None:
        pass

    def do_PATCH(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).seen.append({"method": "PATCH", "path": self.path, "type": self.headers["Content-Type"],
                                "body": json.loads(body)})
        data = json.dumps({"error": {"message": "no parked conversation 'conv/a b'"}}).encode()
        self.send_response(404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_the_client_sends_the_change_as_the_api_declares_it(qtbot):
    from desktop.client import Dispatcher, EngineClient, change_failure, check_conversation_change

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    dispatcher = Dispatcher()
    client = EngineClient(dispatcher)
    client.set_target(f"http://127.0.0.1:{server.server_address[1]}")
    replies = []
    try:
        client.change_conversation("conv/a b", {"priority": "low", "pinned": True}, replies.append)
        qtbot.waitUntil(lambda: bool(replies), timeout=5000)
    finally:
        dispatcher.close()
        client.close()
        server.shutdown()
    assert _Recorder.seen == [{"method": "PATCH", "path": "/cache/conversations/conv%2Fa%20b",
                               "type": "application/json", "body": {"priority": "low", "pinned": True}}]
    assert replies[0].status == 404
    assert change_failure("conv/a b", replies[0]) == ("conv/a b is no longer parked, so there is nothing to "
                                                      "change. The engine said: no parked conversation 'conv/a b'")
    for bad in ({}, {"priority": "urgent"}, {"pinned": "yes"}, {"name": "x"}):
        with pytest.raises(ValueError):
            check_conversation_change(bad)


def test_the_conversations_table_shows_name_client_priority_and_pin(qtbot):
    from desktop.monitor import MonitorTab

    tab = MonitorTab()
    qtbot.addWidget(tab)
    tab.set_conversations([
        conversation_row("c1", "ram", tokens=10, bytes=100, created=1.0, last_used=2.0, hits=0,
                         name="Fix the parser", client="OpenAI/Python", priority="high", pinned=True,
                         system="You are a careful coder"),
        conversation_row("c2", "ram", tokens=10, bytes=100, created=1.0, last_used=1.0, hits=0),
    ])
    m = tab.model
    assert _cells(m, 0)[0] == "Fix the parser" and _cells(m, 0)[7:10] == ["OpenAI/Python", "high", "pinned"]
    assert m.index(0, 0).data(Qt.ItemDataRole.ToolTipRole) == "Fix the parser · c1\nSystem: You are a careful coder"
    assert m.index(1, 0).data(Qt.ItemDataRole.ToolTipRole) == "c2", "no name, no system words: the id alone"
    assert _cells(m, 1)[0] == "c2" and _cells(m, 1)[7:] == ["–", "normal", "", "–"], "an older engine's row"


def test_every_reason_reads_as_words():
    from desktop.monitor.requests import reason_text, reason_tooltip

    def text(reason, **detail):
        return reason_text(request_record(reason, prompt_tokens=200, detail=detail), now=100.0)

    diverged = request_record("diverged", detail={"diverged_at": 57, "candidate": "slot 0", "candidate_tokens": 90,
                                                  "before": "the ", "prompt_after": "cat", "candidate_after": "dog"})
    assert reason_text(diverged) == "diverged at token 57"
    tip = reason_tooltip(diverged)
    assert "…the ⟦cat⟧" in tip and "…the ⟦dog⟧" in tip and "slot 0 (90 tokens)" in tip
    assert text("floor") == "its park was refused by the free-memory floor"
    assert text("refused", refusal="no_room") == "its park was refused (no_room)"
    assert text("n_min", offered=100, n_min=10000) == f"hit of 100 tokens < n-min 10{NNBSP}000"
    assert text("similarity", offered=50, similarity=0.9) == "hit covers 25% < similarity 90%"
    assert text("cost", predicted_restore_s=0.012, predicted_prefill_s=0.003) == "restore 12.0 ms ≥ prefill 3.0 ms"
    assert text("cost") == "not worth restoring (cost model)"
    assert text("evicted", kind="purge", when=40.0, by="purge") == "purged 60 s ago"
    assert text("restore_failed") == "restore failed" and text("something new") == "something new"


def test_the_request_log_of_a_real_engine_and_a_parked_conversations_history(qtbot, tmp_path):
    """The app starts the real engine (a tiny model); two conversations take turns on its one slot."""
    import openai

    from desktop.engine_process import EngineState
    from desktop.main_window import MainWindow
    from desktop.settings import Paths
    from tests.model_fixtures import write_tiny_model

    w = MainWindow(Paths(tmp_path / "cfg", tmp_path / "state"), use_tray=False, environ={})
    for name, value in (("port", 0), ("parallel", 1), ("model", write_tiny_model(tmp_path, "llama")),
                        ("ctx_size", 512), ("conversation_cache_dir", str(tmp_path / "parked")),
                        ("conversation_cache_min_free_mib", 0)):
        w.store.set(name, value)
    qtbot.addWidget(w)
    w.show()
    w.tabs.setCurrentWidget(w.monitor)
    try:
        w.start()
        qtbot.waitUntil(lambda: w.engine.state is EngineState.READY, timeout=60000)
        client = openai.OpenAI(base_url=w.client.base_url + "/v1", api_key="none", max_retries=0, timeout=60)

        def ask(text: str) -> str:
            return client.completions.create(model="m", prompt=text, max_tokens=1, temperature=0).id

        first = ask("The quick brown fox jumps over the lazy dog. " * 6)
        ask("Paris is the capital of France; Berlin is the capital of Germany. " * 6)  # parks the first
        back = ask("The quick brown fox jumps over the lazy dog. " * 6 + "Hello, world!")
        monitor = w.monitor
        qtbot.waitUntil(lambda: monitor.requests.model.rowCount() == 3 and monitor.model.rowCount() >= 1,
                        timeout=15000)
        newest = _cells(monitor.requests.model, 0)
        assert newest[4] == "RAM" and newest[5].startswith("new tokens only"), newest
        assert monitor.requests.model.rows[0].request_id == back
        line = monitor.requests.model.rows[0].conversation_id
        _select(qtbot, monitor, line)
        history = monitor.requests.model.rows
        assert [r.request_id for r in history] == [back, first], "its requests, newest first"
        assert monitor.requests.summary.text().startswith("2 requests · reused ")
    finally:
        w.shutdown_now()
