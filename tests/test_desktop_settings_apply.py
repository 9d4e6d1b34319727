"""Settings tab against a running engine: Reset applies a live setting as an edit does, the last apply's outcome
is not left under values it no longer describes, and the Copy button stays where it was while those lines change."""

from __future__ import annotations

import os

os.environ["QT_QPA_PLATFORM"] = "offscreen"

from desktop.settings import AutoSaver, SettingsStore


def _running_tab(qtbot, tmp_path):
    from desktop.client import Dispatcher
    from desktop.engine_process import EngineState
    from desktop.settings_tab import SettingsTab

    store = SettingsStore(tmp_path / "s.json", environ={})
    store.set("conversation_cache_days", 20.0)
    dispatcher = Dispatcher()
    saver = AutoSaver(store, dispatcher.submit, delay_ms=50)
    tab = SettingsTab(store, saver, dispatcher.submit, gpu=False)
    qtbot.addWidget(tab)
    tab.set_engine(EngineState.READY, store.engine_config())  # the engine runs with Expiry = 20
    return tab, store, dispatcher


def test_reset_of_a_live_setting_is_applied_to_the_running_engine(qtbot, tmp_path):
    tab, store, dispatcher = _running_tab(qtbot, tmp_path)
    tab.show_result("Applied to the running engine: Expiry = 20.0.", True)
    with qtbot.waitSignal(tab.apply_requested, timeout=2000) as sent:
        tab.reset("conversation_cache_days")
    assert sent.args == [{"conversation_cache_days": 30.0}], "the default is sent, not only saved"
    assert "20.0" not in tab.result.text(), "the outcome of the earlier apply is not left under the reset value"
    assert "Applying" in tab.result.text()
    dispatcher.close()


def test_an_outcome_is_forgotten_when_values_or_the_engine_change(qtbot, tmp_path):
    from desktop.engine_process import EngineState

    tab, store, dispatcher = _running_tab(qtbot, tmp_path)
    tab.show_result("Applied to the running engine: Expiry = 20.0.", True)
    tab.rows["port"].editor.setText("9001")
    tab._commit("port")  # Enter in the field: a restart setting, nothing is applied
    assert tab.result.text() == "", "the line spoke of another edit"
    assert "need a restart: Port" in tab.pending.text()

    tab.show_result("The engine refused the change: no", False)
    tab.set_engine(EngineState.STARTING, None)
    assert tab.result.text() == "", "an outcome from the engine before a restart is not this engine's"
    dispatcher.close()


def test_the_copy_button_does_not_move_when_the_lines_above_it_change(qtbot, tmp_path):
    from PySide6.QtCore import QPoint

    tab, store, dispatcher = _running_tab(qtbot, tmp_path)
    tab.resize(900, 640)
    tab.show()
    qtbot.waitExposed(tab)

    def copy_at() -> QPoint:
        qtbot.wait(20)  # layouts settle on the event loop
        return tab.copy_button.mapTo(tab, QPoint(0, 0))

    before = copy_at()
    tab.show_result("Applied to the running engine: " + ", ".join(["RAM budget = 4 GiB"] * 12) + ".", True)
    assert copy_at() == before
    assert tab.result.height() > tab.fontMetrics().lineSpacing() * 1.5, "the outcome wraps onto several lines"
    store.set("port", 9002)
    store.set("conversation_cache_mib", 1024)
    tab.refresh()  # now both "not applied yet" and "need a restart", on more than one line
    assert copy_at() == before
    tab.show_result("", True)
    assert copy_at() == before
    dispatcher.close()


def test_summed_and_unique_bytes_are_told_apart_where_both_are_shown(qtbot):
    """A conversation's Size counts the blocks it shares with others; the RAM and Disk bars count each once. The
    eviction question and the parked list's Size say which they are, so 38.6 MiB for 28.6 MiB of files reads right."""
    from PySide6.QtCore import Qt

    from desktop.eviction import Eviction, describe
    from desktop.monitor.conversations import ConversationsModel

    question = describe([Eviction("disk", 6, 38.6 * (1 << 20), 6, "10 MiB")])
    assert "drops 6 of 6 parked conversations (38.6 MiB)" in question
    assert "added up" in question and "stored once" in question
    model = ConversationsModel()
    size = ConversationsModel.COLUMNS.index("Size")
    tip = model.headerData(size, Qt.Orientation.Horizontal, Qt.ItemDataRole.ToolTipRole)
    assert "count a shared block once" in tip


def test_test_connection_says_whether_the_store_answers_and_never_shows_its_password(qtbot, tmp_path):
    from PySide6.QtWidgets import QToolButton

    from tests.redis_server import free_port, redis_server

    tab, _, _ = _running_tab(qtbot, tmp_path)
    row = tab.rows["conversation_cache_remote"]
    button = row.container.findChild(QToolButton, "conversation_cache_remote_test")
    with redis_server(tmp_path, password="hunter2") as server:
        tab.set_text("conversation_cache_remote", f"redis://:hunter2@127.0.0.1:{server.port}/0")
        button.click()
        qtbot.waitUntil(lambda: "answers" in row.check.text(), timeout=10000)
        assert "Redis 7" in row.check.text() and "256 MiB" in row.check.text() and "allkeys-lru" in row.check.text()
        assert "hunter2" not in row.check.text() and ":***@" in row.check.text()
    tab.set_text("conversation_cache_remote", f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    button.click()
    qtbot.waitUntil(lambda: "does not answer" in row.check.text(), timeout=10000)
