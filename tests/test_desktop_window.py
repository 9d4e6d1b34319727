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
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QMessageBox

from desktop.engine_process import EngineState
from desktop.main_window import MainWindow
from desktop.settings import Paths
from tests.test_desktop_support import fake_engine_command

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def window(qtbot, tmp_path):
    w = MainWindow(Paths(tmp_path / "cfg", tmp_path / "state"), use_tray=False, environ={})
    w.engine.command_for = fake_engine_command()
    w.store.set("port", 0)
    qtbot.addWidget(w)
    w.show()
    yield w
    w.shutdown_now()


def ready(qtbot, w: MainWindow) -> None:
    qtbot.waitUntil(lambda: w.engine.state is EngineState.READY, timeout=15000)


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
    qtbot.waitUntil(lambda: "MB/s" in labels["park_ms"].text(), timeout=5000)
    assert labels["park_ms"].text() == "last 4.0 ms · median 4.0 ms · p95 4.0 ms · 750 MB/s"
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
    box = window.purge_box
    assert box is not None and "Drop 1 parked conversation (2.9 MiB) from RAM?" in box.text()
    box.button(QMessageBox.StandardButton.Cancel).click()
    qtbot.wait(200)
    assert window.last_purge is None
    window.monitor.purge_actions["all"].trigger()
    assert "Drop 2 parked conversations (4.8 MiB) from RAM and disk?" in window.purge_box.text()
    window.purge_box.button(QMessageBox.StandardButton.Yes).click()
    qtbot.waitUntil(lambda: window.last_purge is not None, timeout=5000)
    assert window.last_purge["dropped"]["conversations"] == 2
    assert "dropped 2 conversation(s), 4.8 MiB" in window.statusBar().currentMessage()
    qtbot.waitUntil(lambda: window.monitor.model.rowCount() == 0, timeout=5000)


def test_live_setting_applies_and_restart_setting_is_offered_not_forced(qtbot, window):
    window.start()
    ready(qtbot, window)
    tab = window.settings_tab
    assert tab.pending.text() == "The running engine uses these settings."
    tab.set_text("conversation_cache_storage", "disk")
    tab.set_text("ctx_size", "4096")
    assert "can apply live: Storage mode" in tab.pending.text()
    assert "need a restart: Context length" in tab.pending.text()
    assert tab.apply_button.isEnabled() and not tab.restart_button.isHidden()
    tab.apply_button.click()
    qtbot.waitUntil(lambda: "Applied to the running engine" in tab.result.text(), timeout=5000)
    qtbot.waitUntil(lambda: window.monitor.counters.labels["storage"].text().startswith("disk"), timeout=5000)
    assert window.engine.state is EngineState.READY, "a live change does not restart"
    assert "need a restart: Context length" in tab.pending.text() and not tab.apply_button.isEnabled()
    pid = window.engine.pid
    tab.restart_button.click()
    qtbot.waitUntil(lambda: window.engine.state is EngineState.READY and window.engine.pid != pid, timeout=15000)
    assert "--ctx-size" in window.engine.command
    assert tab.pending.text() == "The running engine uses these settings."


def test_engine_refusal_is_shown(qtbot, window):
    window.start()
    ready(qtbot, window)
    window.apply_live({"threads": 3})  # not a live setting: the engine says no
    qtbot.waitUntil(lambda: "refused" in window.settings_tab.result.text(), timeout=5000)
    assert "not a live setting: threads" in window.settings_tab.result.text()


def test_stop_greys_the_monitor_and_crash_shows_restart(qtbot, window):
    window.start()
    ready(qtbot, window)
    qtbot.waitUntil(lambda: window.monitor.model.rowCount() == 2, timeout=5000)
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
    assert window.purge_box is not None and window.tabs.currentWidget() is window.monitor
    window.purge_box.button(QMessageBox.StandardButton.Cancel).click()


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


def test_monitor_tolerates_missing_and_odd_keys(qtbot):
    from desktop.client import sample_memory
    from desktop.monitor import MonitorTab

    tab = MonitorTab()
    qtbot.addWidget(tab)
    tab.set_memory(sample_memory(None))  # before the plots exist: kept and replayed
    tab.ensure_plots()
    for metrics in ({}, {"engine": None}, {"conversation_cache": {"budgets": None, "park_ms": 3}},
                    {"engine": {"model": "m"}, "conversation_cache": {"enabled": False}}):
        tab.set_metrics(metrics)
    tab.set_conversations([{"id": "x"}, {"tier": ["ram", "disk"], "created": "2024-01-01T00:00:00Z"}, "junk"])
    tab.set_events([{"kind": "park"}, {"kind": "restore", "time": 1.0, "ms": "?"}, {}])
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
    assert out.stdout.strip() == "False ['engine', 'engine.config']"


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


def _overlaps(widgets) -> list[tuple[str, str]]:
    from PySide6.QtCore import QRect

    rects = [(w.text() if hasattr(w, "text") else w.objectName(), QRect(w.mapToGlobal(w.rect().topLeft()), w.size()))
             for w in widgets if w.isVisible()]
    return [(a, b) for i, (a, ra) in enumerate(rects) for b, rb in rects[i + 1:] if ra.intersects(rb)]


def test_monitor_at_800x560_scrolls_instead_of_overlapping_rows(qtbot, window):
    from PySide6.QtWidgets import QLabel, QProgressBar

    window.start()
    ready(qtbot, window)
    qtbot.waitUntil(lambda: window.monitor.counters.labels["storage"].text() == "ram", timeout=5000)
    window.resize(800, 560)
    qtbot.wait(100)
    assert window.size().width() == 800 and window.size().height() == 560, "800x560 is allowed"
    window.resize(300, 200)
    qtbot.wait(50)
    assert window.width() >= 700 and window.height() >= 500, "a minimum size"
    window.resize(800, 560)
    qtbot.wait(100)
    counters = window.monitor.counters
    parts = counters.findChildren(QLabel) + counters.findChildren(QProgressBar)
    for part in parts:
        if part.isVisible():
            assert part.height() >= part.minimumSizeHint().height(), f"{part.objectName()} squeezed"
    assert _overlaps(parts) == []
    assert window.monitor.table.height() >= window.monitor.table.minimumHeight()
    assert window.monitor.scroll.verticalScrollBar().maximum() > 0, "the Monitor scrolls at this size"


def test_layout_does_not_jump(qtbot, window):
    """The status bar's first message and a missed poll or two during generation move nothing."""
    window.resize(window.minimumSize())
    qtbot.wait(50)
    size = window.size()
    central = window.centralWidget().geometry()
    window.statusBar().showMessage("Purged all: dropped 2 conversation(s), 4.8 MiB.")
    qtbot.wait(50)
    assert window.size() == size and window.centralWidget().geometry() == central


    # The Monitor alone (no poller answering in between): a missed poll is what the poller reports.
    from desktop.monitor import MonitorTab

    monitor = MonitorTab()
    qtbot.addWidget(monitor)
    monitor.set_engine_state(EngineState.READY)
    monitor.resize(900, 700)
    monitor.show()
    qtbot.wait(20)
    purge_at = monitor.purge_button.mapTo(monitor, monitor.purge_button.rect().topLeft())
    monitor.set_unreachable("no answer within 2 s")
    monitor.set_unreachable("no answer within 2 s")
    qtbot.wait(20)
    assert monitor.banner.isHidden(), "one or two missed polls (a long generation step) show nothing"
    assert monitor.purge_button.mapTo(monitor, monitor.purge_button.rect().topLeft()) == purge_at
    monitor.clear_unreachable()
    monitor.set_unreachable("no answer within 2 s")
    monitor.set_unreachable("no answer within 2 s")
    assert monitor.banner.isHidden(), "an answer in between starts the count again"
    monitor.set_unreachable("no answer within 2 s")
    assert not monitor.banner.isHidden() and "did not answer" in monitor.banner.text()
    monitor.clear_unreachable()
    assert monitor.banner.isHidden()


def test_timing_plot_empty_restart_and_legend(qtbot):
    import time

    from desktop.monitor import MonitorTab

    tab = MonitorTab()
    qtbot.addWidget(tab)
    tab.ensure_plots()
    tab.resize(1000, 700)
    tab.show()
    plot = tab.timings
    plot.redraw()
    item = plot.plot.getPlotItem()
    assert item.legend is None, "no legend box inside the plot to cover points"
    assert "Park" in item.titleLabel.text and "restore" in item.titleLabel.text
    assert plot.empty and plot.empty_label.isVisible()
    assert item.getAxis("left").style["showValues"] is False, "no made-up ms scale while empty"
    from desktop.client import sample_memory

    def scale_shown(plot_widget) -> bool:
        return plot_widget.getPlotItem().getAxis("left").style["showValues"]

    assert not scale_shown(tab.memory.engine_plot) and not scale_shown(tab.memory.host_plot)
    tab.set_memory(sample_memory(None))  # no engine process: no engine memory, host memory known
    assert not scale_shown(tab.memory.engine_plot) and scale_shown(tab.memory.host_plot)

    old = time.time() - 3600  # the previous engine's events, an hour ago
    tab.set_events([{"kind": "park", "time": old, "ms": 40.0}, {"kind": "restore", "time": old + 5, "ms": 9.0}])
    assert not plot.empty and item.getAxis("left").style["showValues"] is True
    lo, hi = item.viewRange()[0]
    assert lo <= old <= hi
    assert item.viewRange()[1][1] >= 40.0, "the points are inside the y range"

    tab.engine_restarted()
    lo, hi = item.viewRange()[0]
    assert plot.empty and len(plot.park.data) == 0 and hi > time.time() - 5 and lo > old + 5
    assert item.getAxis("left").style["showValues"] is False

    timing = {"last": 0.0, "p50": 0.0, "p95": 0.0, "count": 0}
    tab.set_metrics({"conversation_cache": {"parks": 0, "restores": 0, "park_ms": timing, "restore_ms": timing}})
    assert tab.counters.labels["park_ms"].text() == "–" and tab.counters.labels["restore_ms"].text() == "–"
    tab.set_metrics({"conversation_cache": {"parks": 0, "restores": 0, "park_ms": {"last": 0.0}}})
    assert tab.counters.labels["park_ms"].text() == "–"


def test_tiered_conversation_shows_once_with_its_history(qtbot):
    """The engine lists a tiered conversation once per tier holding it; the table shows one row."""
    from desktop.monitor import MonitorTab
    from desktop.monitor.conversations import merge_tiers

    listed = [
        {"id": "conv-a", "tokens": 1200, "bytes": 3_000_000, "tier": "ram", "created": 100.0, "last_used": 200.0,
         "hits": 4, "pending": False},
        {"id": "conv-b", "tokens": 800, "bytes": 2_000_000, "tier": "disk", "created": 120.0, "last_used": 150.0,
         "hits": 1, "pending": False},
        {"id": "conv-a", "tokens": 1200, "bytes": 1_000_000, "tier": "disk", "created": 90.0, "last_used": 180.0,
         "hits": 0, "pending": True},
    ]
    tab = MonitorTab()
    qtbot.addWidget(tab)
    tab.set_conversations(listed)
    model = tab.model
    assert model.rowCount() == 2
    ids = [model.index(r, 0).data() for r in range(2)]
    assert ids == ["conv-a", "conv-b"]
    a = model.rows[0]
    assert model.index(0, 3).data() == "RAM + disk" and model.index(1, 3).data() == "disk"
    assert a["hits"] == 4 and a["created"] == 90.0 and a["last_used"] == 200.0 and a["pending"] is True
    assert model.index(0, 6).data() == "4", "the hits it had in RAM are kept, not a new row with 0"
    assert model.index(0, 2).data() == "3.8 MiB"
    assert "RAM 2.9 MiB" in model.index(0, 2).data(Qt.ItemDataRole.ToolTipRole)
    assert merge_tiers(listed[:2]) == listed[:2], "conversations in one tier pass through unchanged"
    assert merge_tiers([{"tier": "ram"}, "junk"]) == [{"tier": "ram"}], "rows without an id kept, junk dropped"


def test_purge_counts_a_tiered_conversation_once(qtbot, window):
    window._on_conversations([{"id": "x", "tier": "ram", "bytes": 10}, {"id": "x", "tier": "disk", "bytes": 5}])
    assert window.purge_summary("all")[0] == 1
    assert window.purge_summary("ram")[0] == 1 and window.purge_summary("disk")[0] == 1


def test_a_smaller_budget_says_what_it_evicts_and_asks_first(qtbot, window):
    window.start()
    ready(qtbot, window)
    qtbot.waitUntil(lambda: window.conversations is not None and len(window.conversations) == 2, timeout=5000)
    qtbot.waitUntil(lambda: window.metrics is not None, timeout=5000)
    tab = window.settings_tab
    tab.set_text("conversation_cache_mib", "2")  # conv-a (2.9 MiB, in RAM) no longer fits
    assert tab.apply_button.isEnabled()
    tab.apply_button.click()
    box = window.apply_box
    assert box is not None, "asked before applying"
    assert "drops 1 of 1 parked conversation (2.9 MiB) from RAM, to fit the RAM budget of 2 MiB" in box.text()
    assert "estimate" in box.text()
    box.button(QMessageBox.StandardButton.Cancel).click()
    qtbot.waitUntil(lambda: "Not applied" in tab.result.text(), timeout=3000)
    assert window.engine.config.conversation_cache_mib == 4096, "nothing was sent"
    tab.apply_button.click()
    window.apply_box.button(QMessageBox.StandardButton.Yes).click()
    qtbot.waitUntil(lambda: "Applied to the running engine" in tab.result.text(), timeout=5000)
    assert window.engine.config.conversation_cache_mib == 2

    tab.set_text("conversation_cache_mib", "8 GiB")  # growing evicts nothing: applied without a question
    tab.apply_button.click()
    assert window.apply_box is None
    qtbot.waitUntil(lambda: window.engine.config.conversation_cache_mib == 8192, timeout=5000)


def test_eviction_estimate_replays_lru():
    from desktop import eviction

    mib = 1 << 20
    rows = [{"id": "new", "tier": "ram", "bytes": 10 * mib, "last_used": 300},
            {"id": "mid", "tier": ["ram", "disk"], "bytes": 30 * mib, "bytes_by_tier": {"ram": 20 * mib, "disk": 10 * mib},
             "last_used": 200},
            {"id": "old", "tier": "disk", "bytes": 40 * mib, "last_used": 100}]
    running = {"conversation_cache_mib": 2048, "conversation_cache_disk_mib": 2048, "conversation_cache_slots": 64}
    ram = eviction.estimate(rows, "tiered", running, {"conversation_cache_mib": 25})
    assert ram == [eviction.Eviction("ram", 1, 20 * mib, 2, "25 MiB", spilled=True)]
    assert "moves 1 of 2 parked conversations (20.0 MiB) from RAM to disk" in eviction.describe(ram)
    disk = eviction.estimate(rows, "tiered", running, {"conversation_cache_disk_mib": 45})
    assert disk == [eviction.Eviction("disk", 1, 40 * mib, 2, "45 MiB")], "the older one goes"
    assert eviction.estimate(rows, "ram", running, {"conversation_cache_disk_mib": 1}) == [], "disk unused"
    slots = eviction.estimate(rows, "tiered", running, {"conversation_cache_slots": 1})
    assert slots == [eviction.Eviction("slots", 2, 70 * mib, 3, "1 conversation")]
    assert eviction.estimate(rows, "tiered", running, {"conversation_cache_mib": 4096}) == []


def test_logs_tab_counts_filters_and_says_when_follow_is_off(qtbot):
    from desktop.logs_tab import LogsTab

    tab = LogsTab()
    qtbot.addWidget(tab)
    tab.show()
    for i in range(30):
        tab.append_line(f"{'WARNING' if i % 10 == 0 else 'INFO'} step {i}")
    tab.search.setText("warning")
    assert tab.search_status.text() == "3 matches"
    tab.append_line("WARNING late")
    assert tab.search_status.text() == "4 matches", "the count follows new lines"
    tab.filter.setChecked(True)
    assert tab.text().splitlines() == ["WARNING step 0", "WARNING step 10", "WARNING step 20", "WARNING late"]
    tab.append_line("INFO hidden")
    tab.append_line("WARNING shown")
    assert tab.text().splitlines()[-1] == "WARNING shown" and "INFO hidden" not in tab.text()
    tab.filter.setChecked(False)
    assert len(tab.text().splitlines()) == 33, "every line is back"
    assert tab.follow_off.isHidden()
    tab.find_next()  # reading a match turns Follow off, and the tab says so
    assert not tab.follow.isChecked() and not tab.follow_off.isHidden()
    tab.follow.setChecked(True)
    assert tab.follow_off.isHidden()
    tab.search.setText("nothing like this")
    assert tab.search_status.text() == "not found"


def test_engine_and_app_lines_go_to_rotating_files_in_the_log_folder(qtbot, tmp_path):
    from desktop.log_files import DESKTOP_LOG, ENGINE_LOG, LogFiles

    files = LogFiles(tmp_path / "logs", max_bytes=2000, backups=2)
    for i in range(100):
        files.write_line(f"engine line {i} " + "x" * 40)
    files.write_line("strata-desktop: the engine was killed by SIGKILL")
    files.close()
    engine_logs = sorted(p.name for p in (tmp_path / "logs").glob(ENGINE_LOG + "*"))
    assert engine_logs == [ENGINE_LOG, ENGINE_LOG + ".1", ENGINE_LOG + ".2"], "rotated, two kept"
    assert "engine line 99" in (tmp_path / "logs" / ENGINE_LOG).read_text()
    assert all(p.stat().st_size <= 2100 for p in (tmp_path / "logs").iterdir())
    desktop = (tmp_path / "logs" / DESKTOP_LOG).read_text()
    assert "killed by SIGKILL" in desktop and "engine line" not in desktop


def test_window_writes_the_logs_to_its_log_folder(qtbot, window):
    window.start()
    ready(qtbot, window)
    logs = window.paths.logs
    assert window.logs.log_dir == logs and window.logs.folder_button.isEnabled()
    window.stop_button.click()
    qtbot.waitUntil(lambda: window.engine.state is EngineState.STOPPED, timeout=10000)
    window.shutdown_now()  # closes the files: what was queued is written
    assert "strata: listening on" in (logs / "engine.log").read_text()
    assert "strata-desktop: starting" in (logs / "desktop.log").read_text()
