"""The main window with a stand-in engine child: Monitor, purge, live apply, crash, stop, quit, tray actions."""

from __future__ import annotations

import os

os.environ["QT_QPA_PLATFORM"] = "offscreen"

import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
from PySide6.QtWidgets import QMessageBox

from desktop.engine_process import EngineState
from desktop.main_window import MainWindow
from desktop.settings import Paths
from tests.test_desktop_support import fake_engine_command, stand_in_window, wait_ready

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def window(qtbot, tmp_path):
    yield from stand_in_window(qtbot, tmp_path)


ready = wait_ready


def test_start_shows_ready_and_the_monitor_renders_what_the_engine_reports(qtbot, window):
    window.start()
    ready(qtbot, window)
    assert "Ready" in window.state_label.text() and window.url_label.text().endswith("/v1")
    assert window.monitor.banner.isHidden()
    qtbot.waitUntil(lambda: window.monitor.model.rowCount() == 2, timeout=5000)
    model = window.monitor.model
    assert [model.index(r, 0).data() for r in range(2)] == ["conv-a", "conv-b"]
    assert model.index(0, 3).data() == "RAM" and model.index(1, 3).data() == "disk"
    assert model.index(0, 2).data() == "2.9 MiB"
    qtbot.waitUntil(lambda: window.monitor.counters.labels["storage"].text() == "ram", timeout=5000)
    labels = window.monitor.counters.labels
    assert labels["hit_rate"].text().startswith("67%")
    assert labels["tokens_saved"].text() == "2\u202f400"
    assert labels["drafts"].text() == "30 of 40 accepted (75%)"  # --spec: the engine's draft tokens
    qtbot.waitUntil(lambda: "MiB/s" in labels["park_ms"].text(), timeout=5000)
    assert labels["park_ms"].text() == "last 4.0 ms · median 4.0 ms · p95 4.0 ms · 715 MiB/s"  # 3 MB in 4 ms
    assert labels["restore_ms"].text().endswith(" · 1\u202f431 MiB/s"), "one thousands separator everywhere"
    assert window.monitor.counters.ram_bar.format().startswith("2.9 MiB of 4.0 GiB")
    assert window.monitor.memory.floor_line.isVisible() and window.monitor.memory.floor_line.value() == 1024
    qtbot.waitUntil(lambda: window.monitor.memory.engine_rss.last() is not None, timeout=5000)
    qtbot.waitUntil(lambda: window.settings_tab.effective_dir == "/tmp/stand-in-cache", timeout=5000)


def test_purge_confirms_with_counts_and_shows_the_result(qtbot, window):
    window.start()
    ready(qtbot, window)
    qtbot.waitUntil(lambda: window.monitor.model.rowCount() == 2, timeout=5000)
    qtbot.waitUntil(lambda: window.metrics is not None, timeout=5000)
    window.monitor.purge_actions["ram"].trigger()
    box = window.purger.box
    assert box is not None and "Drop 1 parked conversation (2.9 MiB) from RAM?" in box.text()
    box.button(QMessageBox.StandardButton.Cancel).click()
    qtbot.wait(200)
    assert window.purger.last is None
    window.monitor.purge_actions["all"].trigger()
    assert "Drop 2 parked conversations (4.8 MiB) from RAM and disk?" in window.purger.box.text()
    window.purger.box.button(QMessageBox.StandardButton.Yes).click()
    qtbot.waitUntil(lambda: window.purger.last is not None, timeout=5000)
    assert window.purger.last.dropped.conversations == 2
    assert "dropped 2 conversation(s), 4.8 MiB" in window.statusBar().currentMessage()
    qtbot.waitUntil(lambda: window.monitor.model.rowCount() == 0, timeout=5000)


def test_live_setting_applies_and_restart_setting_is_offered_not_forced(qtbot, window):
    window.start()
    ready(qtbot, window)
    tab = window.settings_tab
    assert tab.pending.text() == "The running engine uses these settings."
    tab.set_text("conversation_cache_storage", "disk")  # a choice is whole: applied at once, no Apply click
    assert "applying live: Storage mode" in tab.pending.text()
    qtbot.waitUntil(lambda: "Applied to the running engine: Storage mode = disk" in tab.result.text(), timeout=5000)
    qtbot.waitUntil(lambda: window.monitor.counters.labels["storage"].text().startswith("disk"), timeout=5000)
    assert window.engine.state is EngineState.READY, "a live change does not restart"
    tab.set_text("ctx_size", "4096")
    assert "need a restart: Context length" in tab.pending.text() and not tab.restart_button.isHidden()
    assert tab.apply_button.isHidden(), "nothing live is left to apply"
    pid = window.engine.pid
    tab.restart_button.click()
    qtbot.waitUntil(lambda: window.engine.state is EngineState.READY and window.engine.pid != pid, timeout=15000)
    assert "--ctx-size" in window.engine.command
    assert tab.pending.text() == "The running engine uses these settings."


def test_a_live_setting_changed_by_another_client_is_followed_and_can_be_sent_back(qtbot, window):
    import httpx

    window.start()
    ready(qtbot, window)
    tab = window.settings_tab
    assert tab.pending.text() == "The running engine uses these settings."
    put = httpx.put(f"{window.client.base_url}/cache/config", json={"conversation_cache_storage": "disk"})
    assert put.status_code == 200  # a script beside the app
    qtbot.waitUntil(lambda: "another client" in tab.result.text(), timeout=5000)
    assert "Storage mode = disk" in tab.result.text() and window.engine.config.conversation_cache_storage == "disk"
    assert "not applied yet: Storage mode" in tab.pending.text() and not tab.apply_button.isHidden()
    tab.apply_button.click()  # this app's setting back into the engine
    qtbot.waitUntil(lambda: "Applied to the running engine: Storage mode = ram" in tab.result.text(), timeout=5000)
    assert tab.pending.text() == "The running engine uses these settings."


def test_engine_refusal_is_shown(qtbot, window):
    window.start()
    ready(qtbot, window)
    window.live.apply({"threads": 3})  # not a live setting: the engine says no
    qtbot.waitUntil(lambda: "refused" in window.settings_tab.result.text(), timeout=5000)
    assert "not a live setting: threads" in window.settings_tab.result.text()


def test_after_a_live_change_the_window_shows_the_engines_answer(qtbot, window):
    window.engine.command_for = fake_engine_command("--most-slots", "40")
    window.start()
    ready(qtbot, window)
    window.live.apply({"conversation_cache_slots": 50})
    qtbot.waitUntil(lambda: "Applied" in window.settings_tab.result.text(), timeout=5000)
    assert "Most conversations = 40" in window.settings_tab.result.text(), "the engine's value, not the one sent"
    assert window.engine.config.conversation_cache_slots == 40


def test_an_answer_of_an_unknown_shape_is_an_error_not_a_success(qtbot, window):
    window.engine.command_for = fake_engine_command("--old-dialect")
    window.start()
    ready(qtbot, window)
    window.live.apply({"conversation_cache_slots": 50})
    qtbot.waitUntil(lambda: "not understood" in window.settings_tab.result.text(), timeout=5000)
    text = window.settings_tab.result.text()
    assert "PUT /cache/config: missing field 'live'" in text and "Applied" not in text
    assert window.engine.config.conversation_cache_slots == 64, "nothing taken from an answer not understood"


def test_stop_greys_the_monitor_and_crash_shows_restart(qtbot, window):
    window.start()
    ready(qtbot, window)
    # Both polls answered (the conversation list and /metrics come separately): the figures the banner dates.
    qtbot.waitUntil(lambda: window.monitor.model.rowCount() == 2 and window.monitor.last_update is not None,
                    timeout=5000)
    window.stop_button.click()
    qtbot.waitUntil(lambda: window.engine.state is EngineState.STOPPED, timeout=10000)
    assert "The engine is stopped." in window.monitor.banner.text() and "Figures below are from" in window.monitor.banner.text()
    assert not window.monitor.table.isEnabled() and window.monitor.model.rowCount() == 2, "last figures stay, greyed"
    assert window.crash_panel.isHidden(), "a requested stop is not a crash"
    assert window.start_button.isEnabled() and not window.stop_button.isEnabled()

    window.start_button.click()
    ready(qtbot, window)
    os.kill(window.engine.pid, signal.SIGKILL)
    qtbot.waitUntil(lambda: not window.crash_panel.isHidden(), timeout=2000)
    assert "was killed by SIGKILL" in window.crash_text.text()
    assert "stopped unexpectedly" in window.monitor.banner.text()
    window.crash_restart.click()
    ready(qtbot, window)
    assert window.crash_panel.isHidden()


def test_quit_stops_the_engine_and_leaves_no_process(qtbot, window):
    window.start()
    ready(qtbot, window)
    pid = window.engine.pid
    with qtbot.waitSignal(window.quit_finished, timeout=15000):
        window.tray.quit_action.trigger()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert not window.paths.pid_file.exists()
    assert window.engine.outcome.requested


def test_tray_actions_and_tooltip(qtbot, window):
    tray = window.tray
    assert tray.engine_action.text() == "Start engine" and not tray.purge_action.isEnabled()
    window.start()
    ready(qtbot, window)
    qtbot.waitUntil(lambda: "2 parked" in tray.icon.toolTip(), timeout=5000)
    assert tray.icon.toolTip().startswith("Strata — Ready · 2 parked · RAM 2.9 MiB · disk 1.9 MiB")
    assert tray.engine_action.text() == "Stop engine" and tray.purge_action.isEnabled()
    tray.engine_action.trigger()
    qtbot.waitUntil(lambda: window.engine.state is EngineState.STOPPED, timeout=10000)
    assert tray.icon.toolTip() == "Strata — Stopped" and tray.engine_action.text() == "Start engine"
    tray.engine_action.trigger()
    ready(qtbot, window)
    window.hide()
    tray.open_action.trigger()
    assert window.isVisible()
    tray.purge_action.trigger()
    assert window.purger.box is not None and window.tabs.currentWidget() is window.monitor
    window.purger.box.button(QMessageBox.StandardButton.Cancel).click()


def test_close_without_a_tray_quits(qtbot, window):
    window.start()
    ready(qtbot, window)
    with qtbot.waitSignal(window.quit_finished, timeout=15000):
        window.close()
    assert window.engine.state is EngineState.STOPPED


def test_settings_load_message_is_shown(qtbot, tmp_path):
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    (cfg / "desktop-settings.json").write_text("{oops")
    w = MainWindow(Paths(cfg, tmp_path / "state"), use_tray=False, environ={})
    qtbot.addWidget(w)
    try:
        assert not w.notice.isHidden() and "damaged" in w.notice.text()
    finally:
        w.shutdown_now()


def test_monitor_renders_bodies_with_only_the_required_fields(qtbot):
    """An older engine's answers: what it does not report is the contract's default (a shape the contract does
    not declare never reaches the Monitor: desktop/client.py refuses it)."""
    from desktop.client import sample_memory
    from desktop.monitor import MonitorTab
    from tests.test_desktop_support import conversation_row, event, metrics_body

    tab = MonitorTab()
    qtbot.addWidget(tab)
    tab.set_memory(sample_memory(None))  # before the plots exist: kept and replayed
    tab.ensure_plots()
    for metrics in (metrics_body(), metrics_body({"model": "m"}, {"enabled": False})):
        tab.set_metrics(metrics)
    tab.set_conversations([conversation_row("x"), conversation_row("y", "ram", created=1704067200.0),
                           conversation_row("y", "disk")])
    tab.set_events([event("park"), event("restore", time=1.0), event("evict")])
    tab.show()
    assert tab.model.rowCount() == 2 and tab.model.index(1, 3).data() == "RAM + disk"


def test_logs_tab_is_bounded_searchable_and_copyable(qtbot):
    from PySide6.QtGui import QGuiApplication

    from desktop.logs_tab import LogsTab

    tab = LogsTab()
    qtbot.addWidget(tab)
    tab.view.setMaximumBlockCount(100)
    for i in range(250):
        tab.append_line(f"line {i}")
    assert tab.view.document().blockCount() == 100
    assert tab.text().splitlines()[0] == "line 150"
    tab.search.setText("line 20")
    assert tab.find_next() and tab.view.textCursor().selectedText() == "line 20"
    tab.search.setText("no such text")
    assert not tab.find_next() and tab.search_status.text() == "not found"
    tab.copy_all()
    assert QGuiApplication.clipboard().text().endswith("line 249")


def test_single_instance_asks_the_first_to_show(qtbot, tmp_path):
    from desktop.instance import SingleInstance, instance_name, notify_running

    name = instance_name(tmp_path)
    assert not notify_running(name, timeout_ms=200)
    first = SingleInstance(name)
    assert first.listen()
    with qtbot.waitSignal(first.activated, timeout=3000):
        assert notify_running(name)
    first.close()


def test_the_settings_folder_is_held_by_one_instance_and_taken_over_from_a_dead_one(tmp_path):
    import subprocess
    import sys

    from desktop.instance import LOCK_NAME, instance_lock

    first = instance_lock(tmp_path)
    assert not isinstance(first, bool) and instance_lock(tmp_path) is False  # a second launch does not get it
    first.unlock()
    again = instance_lock(tmp_path)
    assert not isinstance(again, bool)
    again.unlock()
    if sys.platform.startswith("linux"):  # a folder no lock can be made in: the app runs all the same
        assert instance_lock(Path("/proc/self/no-lock-here")) is True
    # a lock left by a process that is gone (a crash) is taken over
    code = (f"from PySide6.QtCore import QLockFile; lock = QLockFile({str(tmp_path / LOCK_NAME)!r}); "
            "assert lock.tryLock(0); import os; os._exit(0)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert (tmp_path / LOCK_NAME).exists()
    taken = instance_lock(tmp_path)
    assert not isinstance(taken, bool)
    taken.unlock()


def test_building_the_window_never_imports_torch(tmp_path):
    code = textwrap.dedent(f"""
        import os, sys
        os.environ["QT_QPA_PLATFORM"] = "offscreen"
        from pathlib import Path
        from PySide6.QtWidgets import QApplication
        app = QApplication([])
        from desktop.main_window import MainWindow
        from desktop.settings import Paths
        w = MainWindow(Paths(Path({str(tmp_path)!r}) / "c", Path({str(tmp_path)!r}) / "s"), use_tray=False)
        w.show()
        app.processEvents()
        engine_modules = sorted(m for m in sys.modules if m == "engine" or m.startswith("engine."))
        print("torch" in sys.modules, engine_modules)
        w.shutdown_now()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    # engine.store_url: the shared store's URL rules (standard library only), one source for the engine and the app;
    # engine.setting: how a setting is declared and parsed, read by the Settings tab
    assert out.stdout.strip() == ("False ['engine', 'engine.config', 'engine.contract', 'engine.figures', "
                                  "'engine.setting', 'engine.store_url']")


def test_install_desktop_entry_writes_a_valid_launcher(tmp_path):
    from desktop.desktop_entry import install_desktop_entry

    written = install_desktop_entry(tmp_path)
    entry = tmp_path / "applications" / "strata-desktop.desktop"
    assert entry in written and (tmp_path / "icons/hicolor/scalable/apps/strata-desktop.svg").exists()
    text = entry.read_text()
    assert "Exec=" in text and "@EXEC@" not in text and "Icon=strata-desktop" in text
    if shutil.which("desktop-file-validate"):
        result = subprocess.run(["desktop-file-validate", str(entry)], capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr


def test_packaged_resources_match_the_sources():
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    for src in (repo / "resources").iterdir():
        assert (repo / "desktop" / "resources" / src.name).read_bytes() == src.read_bytes(), src.name


def test_second_launch_shows_the_first_and_exits(tmp_path):
    import time

    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    args = [sys.executable, "-m", "desktop", "--no-engine", "--config-dir", str(tmp_path / "c"),
            "--state-dir", str(tmp_path / "s")]
    first = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(3)
        assert first.poll() is None
        second = subprocess.run(args, env=env, capture_output=True, text=True, timeout=30)
        assert second.returncode == 0 and "already running" in second.stderr
        assert first.poll() is None, "the first instance keeps running"
        first.send_signal(signal.SIGTERM)  # reaches the Qt loop: a clean quit
        assert first.wait(timeout=20) == 0
    finally:
        if first.poll() is None:
            first.kill()


def test_frozen_serve_mode_never_loads_qt():
    code = ("import sys; from desktop.app import main; rc = main(['serve', '--port', 'eighty']); "
            "print(rc, 'PySide6' in sys.modules)")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "2 False", out.stdout + out.stderr
    assert "--port" in out.stderr


def test_crash_panel_with_long_log_lines_never_grows_the_window(qtbot, window):
    """A 1366x768 laptop screen: the window fits, and a crash with a long log tail does not grow it."""
    window.engine.command_for = fake_engine_command("--noisy")
    window.resize(1200, 700)
    qtbot.wait(50)
    size = window.size()
    assert window.minimumSizeHint().width() <= 1366 and window.minimumSizeHint().height() <= 700
    window.start()
    ready(qtbot, window)
    os.kill(window.engine.pid, signal.SIGKILL)
    qtbot.waitUntil(lambda: not window.crash_panel.isHidden(), timeout=5000)
    qtbot.wait(100)
    assert window.size() == size, "the window never grows by itself"
    assert window.minimumSizeHint().height() <= 700 and window.minimumSizeHint().width() <= 1366
    assert "noisy line 28" in window.crash_log.toPlainText(), "the log tail is shown, whole lines"
    assert window.crash_log.maximumHeight() <= 200
    for button in (window.crash_restart, window.crash_logs, window.restart_button):
        top_left = button.mapTo(window, button.rect().topLeft())
        bottom_right = button.mapTo(window, button.rect().bottomRight())
        assert window.rect().contains(top_left) and window.rect().contains(bottom_right), button.text()


def test_restart_banner_is_cleared_once_the_engine_is_ready_again(qtbot, window):
    window.engine.auto_restart = True
    window.start()
    ready(qtbot, window)
    os.kill(window.engine.pid, signal.SIGKILL)
    qtbot.waitUntil(lambda: "restarting it in" in window.notice.text() and not window.notice.isHidden(), timeout=5000)
    ready(qtbot, window)
    for tab in (window.monitor, window.settings_tab, window.logs):
        window.tabs.setCurrentWidget(tab)
        assert window.notice.isHidden(), "the restart banner is gone once the engine is Ready"
        assert window.monitor.banner.isHidden()
    assert window.crash_panel.isHidden()


def test_a_busy_port_names_its_owner_and_is_not_retried(qtbot, tmp_path):
    """The real engine on a port this test holds: a configuration error with the owner named, not a crash loop."""
    import socket

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    w = MainWindow(Paths(tmp_path / "cfg", tmp_path / "state"), use_tray=False, environ={})
    qtbot.addWidget(w)
    w.store.set("port", port)
    w.engine.auto_restart = True
    delays: list[float] = []
    w.engine.restart_scheduled.connect(delays.append)
    try:
        w.show()
        w.start_engine()
        qtbot.waitUntil(lambda: not w.crash_panel.isHidden(), timeout=60000)
        me = psutil.Process()
        expected = f"Port {port} is in use by {me.name()} (pid {me.pid}): choose another port in Settings."
        qtbot.waitUntil(lambda: w.crash_text.text() == expected, timeout=10000)
        assert "status 2" not in w.crash_text.text() and "crashed" not in w.notice.text()
        # Labelled as what it is, in the header and the tray: a start refused, not a crash.
        label = f"Not started: port {port} is in use"
        assert label in w.state_label.text() and "Crashed" not in w.state_label.text(), w.state_label.text()
        assert w.tray.icon.toolTip() == f"Strata — {label}"
        qtbot.waitUntil(lambda: w.state_label.width() >= w.state_label.sizeHint().width(), timeout=2000)  # whole
        assert w.monitor.banner.text().startswith(expected)
        assert not w.crash_settings.isHidden()
        qtbot.wait(1500)  # past the first back-off
        assert delays == [] and not w.engine.running and w.engine.state is EngineState.CRASHED
        w.crash_settings.click()
        assert w.tabs.currentWidget() is w.settings_tab
        qtbot.waitUntil(w.settings_tab.rows["port"].editor.hasFocus, timeout=2000)
    finally:
        w.shutdown_now()
        holder.close()


def test_start_up_shows_the_engines_loading_phase_and_bar_then_hides_them(qtbot, window):
    """The stand-in reports 'loading weights' with a growing fraction for 3 s, as the engine's /health does."""
    window.engine.command_for = fake_engine_command("--ready-after", "3")
    header = window.state_label.parentWidget()
    window.start()
    view = window.startup
    qtbot.waitUntil(lambda: view.isVisible() and view.phase.text().startswith("loading weights ·"), timeout=10000)
    qtbot.waitUntil(lambda: view.bar.maximum() > 0 and view.bar.value() > 0, timeout=10000)
    assert "%" in view.phase.text() and window.engine.health.phase == "loading weights"
    assert window.tray.icon.toolTip().startswith("Strata — Loading model · loading weights · ")
    height = header.height()
    ready(qtbot, window)
    assert view.isHidden(), "no start-up progress once the engine is Ready"
    assert header.height() == height, "the header keeps its height when the progress goes"


def test_start_up_view_says_the_phase_in_words_and_busy_when_the_fraction_is_unknown(qtbot):
    from desktop.startup_view import StartupView, describe
    from engine.contract import HealthBody

    view = StartupView()
    qtbot.addWidget(view)
    view.set_state(EngineState.LOADING)
    view.set_health(HealthBody(status="loading", phase="reading model file", elapsed_s=2.4))
    assert view.phase.text() == "reading model file · 2 s"
    assert (view.bar.minimum(), view.bar.maximum()) == (0, 0), "a busy bar where the engine cannot tell"
    view.set_health(HealthBody(status="loading", phase="loading weights", elapsed_s=3.0, progress=0.25))
    assert view.phase.text() == "loading weights · 25% · 3 s" and view.bar.value() == view.bar.maximum() // 4
    assert describe(None) == "starting…"
    view.set_state(EngineState.READY)
    assert view.isHidden()


def test_a_folder_is_applied_on_enter_never_on_a_pause_in_typing(qtbot, window, tmp_path):
    from PySide6.QtCore import Qt
    from PySide6.QtTest import QTest

    from desktop.settings_tab import SETTLE_MS

    window.start()
    ready(qtbot, window)
    tab = window.settings_tab
    editor = tab.rows["conversation_cache_dir"].editor
    folder = str(tmp_path / "parked-here")
    QTest.keyClicks(editor, folder)
    qtbot.waitUntil(lambda: window.store.value("conversation_cache_dir") == folder, timeout=SETTLE_MS * 3)
    qtbot.wait(300)
    assert window.engine.config.conversation_cache_dir != folder, "a pause in a path is not the end of it"
    assert "not applied yet: " in tab.pending.text()
    QTest.keyClick(editor, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: window.engine.config.conversation_cache_dir == folder, timeout=5000)
    assert tab.result.text().startswith("Applied to the running engine: ")


def test_quit_while_typing_keeps_the_value_and_sends_nothing_to_the_stopping_engine(qtbot, window):
    import json

    from PySide6.QtTest import QTest

    window.start()
    ready(qtbot, window)
    qtbot.waitUntil(lambda: window.conversations is not None and len(window.conversations) == 2, timeout=5000)
    editor = window.settings_tab.rows["conversation_cache_mib"].editor
    editor.selectAll()
    QTest.keyClicks(editor, "2")  # would evict conv-a: applied live it would ask first
    with qtbot.waitSignal(window.quit_finished, timeout=15000):
        window.tray.quit_action.trigger()
    assert window.live.box is None, "no question while quitting"
    assert window.engine.config.conversation_cache_mib == 4096, "nothing sent"
    assert json.loads(window.paths.settings_file.read_text())["engine"]["conversation_cache_mib"] == 2, "kept"


def test_open_log_folder_without_a_file_manager_says_where_the_logs_are(qtbot, window):
    """Where nothing can open a folder (no file manager registered; Qt's offscreen platform is such a place),
    the button says so, in the status bar and under the log bar, with the folder's path to select or copy."""
    from PySide6.QtCore import Qt
    from PySide6.QtGui import QGuiApplication

    logs = window.logs
    window.tabs.setCurrentWidget(logs)
    path = str(window.paths.logs)
    assert logs.folder_message.isHidden()
    logs.folder_button.click()
    assert path in window.statusBar().currentMessage()
    assert not logs.folder_message.isHidden() and path in logs.folder_message.text()
    assert "could not" in logs.folder_message.text().lower()
    flags = logs.folder_message.textInteractionFlags()
    assert flags & Qt.TextInteractionFlag.TextSelectableByMouse
    logs.copy_path_button.click()
    assert QGuiApplication.clipboard().text() == path
    assert window.paths.logs.is_dir(), "the folder exists, to be opened by hand"
    assert logs.open_log_folder() is False, "offscreen: nothing opens folders"
