"""The main window: engine status and controls, the Monitor, Chat, Settings and Logs tabs, purge, tray and quit."""

from __future__ import annotations

import time
from typing import Any

from PySide6.QtCore import QSize, Qt, QTimer, Signal
from PySide6.QtGui import QCloseEvent, QIcon, QPaintEvent
from PySide6.QtWidgets import (
    QApplication,
    QLabel,
    QMainWindow,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from desktop.autostart import Autostart
from desktop.cache_actions import change_conversation, drop_conversation
from desktop.chat_store import ChatKeeper
from desktop.chat_tab import ChatTab
from desktop.client import Dispatcher, EngineClient, MemorySample, Poller
from desktop.crash_panel import CrashPanel
from desktop.crash_report import cache_loss, memory_note
from desktop.desktop_entry import resource_path
from desktop.engine_errors import BusyPort, busy_port, describe_busy_port, port_owner, setting_for_error
from desktop.engine_process import SHUTDOWN_GRACE_S, EngineProcess, EngineState, ProcessOutcome
from desktop.header import EngineHeader
from desktop.live_apply import LiveApply
from desktop.log_files import APP_PREFIX, LogFiles
from desktop.logs_tab import LogsTab
from desktop.monitor import MonitorTab
from desktop.monitor.conversations import ParkedConversation, merge_tiers
from desktop.pid_file import reap_orphan
from desktop.purge_flow import PurgeFlow
from desktop.settings import AutoSaver, Paths, SettingsStore
from desktop.settings_tab import SettingsTab
from desktop.startup_view import describe
from desktop.tray import Tray, tray_available
from engine.contract import ConversationRow, MetricsBody

DETAIL_INTERVAL_MS = 1000  # Monitor visible: the 1 s refresh
BACKGROUND_INTERVAL_MS = 5000  # Monitor hidden: enough for the tray's tooltip
DEFAULT_SIZE = (1200, 780)
MINIMUM_SIZE = (760, 520)  # the Monitor scrolls below its own comfortable size; the window never needs more


def app_icon() -> QIcon:
    icon = QIcon(str(resource_path("strata-desktop.svg")))
    for size in (32, 64, 256):
        icon.addFile(str(resource_path(f"strata-desktop-{size}.png")))
    return icon


class MainWindow(QMainWindow):
    """Owns the services (dispatcher, client, engine process, poller, settings) and the views of them."""

    quit_finished = Signal()
    first_painted = Signal()

    def __init__(self, paths: Paths | None = None, *, use_tray: bool | None = None,
                 environ: dict[str, str] | None = None, autostart: Autostart | None = None) -> None:
        super().__init__()
        self.paths = paths or Paths.default()
        self.setWindowTitle("Strata Desktop")
        self.setWindowIcon(app_icon())
        self.setMinimumSize(*MINIMUM_SIZE)
        self.resize(*default_size(self.screen().availableGeometry().size()))

        # Services
        self.dispatcher = Dispatcher(parent=self)
        self.store = SettingsStore(self.paths.settings_file, environ)
        self.load_messages = self.store.load()
        self.autosaver = AutoSaver(self.store, self.dispatcher.submit, parent=self)
        self.client = EngineClient(self.dispatcher, self)
        self.engine = EngineProcess(self.client, self.paths.pid_file, self)
        self.engine.auto_restart = self.store.prefs.auto_restart
        self.poller = Poller(self.client, BACKGROUND_INTERVAL_MS, self)
        self.metrics: MetricsBody | None = None
        self.conversation_rows: list[ConversationRow] | None = None  # as the engine lists them, one per tier
        self.conversations_at = 0.0  # time.monotonic() of that snapshot
        self.memory: MemorySample | None = None  # the last sample (a crash report says if memory ran out)
        self._quitting = False
        self._finished = False  # torn down: nothing of the window runs any more
        self._started = False
        self._painted = False
        self.notice_kind: str | None = None

        # Views
        self.header = header = EngineHeader()
        self.state_label, self.url_label, self.startup = header.state_label, header.url_label, header.startup
        self.start_button, self.stop_button = header.start_button, header.stop_button
        self.restart_button = header.restart_button
        self.start_button.clicked.connect(self.start_engine)
        self.stop_button.clicked.connect(self.stop_engine)
        self.restart_button.clicked.connect(self.restart_engine)

        self.notice = QLabel()
        self.notice.setObjectName("notice")
        self.notice.setWordWrap(True)
        self.notice.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.notice.setStyleSheet("QLabel#notice { background: #e3f2fd; padding: 6px; border-radius: 3px; }")
        self.notice.hide()

        self.crash_panel = CrashPanel()
        self.crash_text, self.crash_log = self.crash_panel.text, self.crash_panel.log
        self.crash_restart, self.crash_logs = self.crash_panel.restart_button, self.crash_panel.logs_button
        self.crash_settings = self.crash_panel.settings_button
        self.crash_restart.clicked.connect(self.start_engine)
        self.crash_settings.clicked.connect(self._open_failed_setting)

        self.monitor = MonitorTab()
        self.settings_tab = SettingsTab(self.store, self.autosaver, self.dispatcher.submit,
                                        autostart if autostart is not None else Autostart())
        self.log_files = LogFiles(self.paths.logs)
        self.logs = LogsTab(self.paths.logs)
        self.tabs = QTabWidget()
        self.chat = ChatTab()
        self.chat_keeper = ChatKeeper(self.paths.chats_file, self.dispatcher.submit, self)
        chats, chats_problem = self.chat_keeper.load()
        self.chat.restore(chats)
        self.tabs.addTab(self.monitor, "Monitor")
        self.tabs.addTab(self.chat, "Chat")
        self.tabs.addTab(self.settings_tab, "Settings")
        self.tabs.addTab(self.logs, "Logs")
        self.crash_logs.clicked.connect(lambda: self.tabs.setCurrentWidget(self.logs))

        central = QWidget()
        layout = QVBoxLayout(central)
        layout.addWidget(header)
        layout.addWidget(self.notice)
        layout.addWidget(self.crash_panel)
        layout.addWidget(self.tabs, 1)
        self.setCentralWidget(central)
        # Made now, not on the first message: a status bar appearing later would grow the window.
        self.statusBar().setSizeGripEnabled(True)

        self.use_tray = tray_available() if use_tray is None else use_tray
        self.tray = Tray(self.windowIcon(), self)
        if self.use_tray:
            self.tray.show()

        # Wiring
        self.engine.state_changed.connect(self._on_state)
        self.engine.line.connect(self.logs.append_line)
        self.engine.line.connect(self.log_files.write_line)
        self.engine.url_changed.connect(header.set_url)
        self.engine.health_changed.connect(self.startup.set_health)
        self.engine.health_changed.connect(lambda _health: self._update_tray())
        self.engine.ended.connect(self._on_ended)
        self.engine.restart_scheduled.connect(
            lambda s: self.show_notice(f"The engine crashed; restarting it in {s:g} s.", kind="restart"))
        self.poller.memory.connect(self._on_memory)
        self.poller.metrics.connect(self._on_metrics)
        self.poller.conversations.connect(self._on_conversations)
        self.poller.events.connect(self.monitor.set_events)
        self.poller.requests.connect(self.monitor.set_requests)
        self.poller.requests_failed.connect(self.monitor.requests.set_error)
        self.monitor.conversation_change_requested.connect(
            lambda cid, changes: change_conversation(self.client, self.monitor, cid, changes, self.poller.poll))
        self.monitor.conversation_drop_requested.connect(
            lambda cid: drop_conversation(self, self.client, self.monitor, cid, self.poller.poll))
        self.poller.conversations_failed.connect(self.monitor.set_conversations_error)
        self.poller.unreachable.connect(self.monitor.set_unreachable)
        self.purger = PurgeFlow(self, self.client, self.cache_snapshot, self.poller.poll,
                                self.statusBar().showMessage)
        self.monitor.purge_requested.connect(self.purger.request)
        self.monitor.visibility_changed.connect(self._monitor_visible)
        self.live = LiveApply(self, self.client, self.engine, self.settings_tab,
                              self.cache_snapshot, self.poller.poll,
                              self.statusBar().showMessage)
        self.settings_tab.apply_requested.connect(self.live.apply)
        self.settings_tab.restart_requested.connect(self.restart_engine)
        self.settings_tab.prefs_changed.connect(self._prefs_changed)
        self.autosaver.failed.connect(self.show_notice)
        self.chat.changed.connect(lambda: self.chat_keeper.save_later(self.chat.kept()))
        self.chat_keeper.failed.connect(self.app_line)
        self.logs.folder_not_opened.connect(lambda text: self.statusBar().showMessage(text, 30000))
        self.tray.open_requested.connect(self.show_window)
        self.tray.start_requested.connect(self.start_engine)
        self.tray.stop_requested.connect(self.stop_engine)
        self.tray.purge_requested.connect(self._purge_from_tray)
        self.tray.quit_requested.connect(self.quit)

        self._on_state(EngineState.STOPPED)
        if chats_problem:
            self.app_line(chats_problem)
        messages = [*self.load_messages, *([self.log_files.error] if self.log_files.error else []),
                    *([chats_problem] if chats_problem else [])]
        if messages:
            self.show_notice("\n".join(messages))

    # ------------------------------------------------------------------ start-up

    def paintEvent(self, event: QPaintEvent) -> None:
        super().paintEvent(event)
        if not self._painted:
            self._painted = True
            self.first_painted.emit()

    def start(self) -> None:
        """After the window is shown: stop an engine orphaned by an earlier session, then start ours."""
        if self._started:
            return
        self._started = True
        self.settings_tab.reload()
        self.monitor.ensure_plots()
        self.poller.start()
        path, client = self.paths.pid_file, self.client
        key = self.store.engine_config().api_key  # what the orphan was most likely started with
        # as long as the engine's own clean stop may take (its spill to disk): a shorter wait killed it mid-spill
        self.dispatcher.submit(lambda: reap_orphan(path, client, grace_s=SHUTDOWN_GRACE_S, api_key=key),
                               self._orphan_checked)

    def _orphan_checked(self, result: Any) -> None:
        if isinstance(result, str):
            self.show_notice(result)
            self.app_line(result)
        elif isinstance(result, BaseException):
            self.app_line(f"could not check for an orphaned engine: {result}")
        if self.store.prefs.start_engine and not self._quitting:
            self.start_engine()

    # ------------------------------------------------------------------ engine control

    def start_engine(self) -> None:
        if self.engine.running:
            return
        self.crash_panel.hide()
        self.engine.start(self.store.engine_config())

    def stop_engine(self) -> None:
        self.engine.stop()
        self.clear_notice("restart")  # stop() cancels a pending automatic restart

    def restart_engine(self) -> None:
        self.crash_panel.hide()
        self.engine.restart(self.store.engine_config())

    def _on_state(self, state: EngineState) -> None:
        self.header.set_state(state, self.engine.running, self.engine.state_text)
        self.monitor.set_engine_state(state)
        self.chat.set_engine(state, self.client.base_url, self.client.api_key)
        self.settings_tab.set_engine(state, self.engine.config if self.engine.running else None)
        self.poller.engine_pid = self.engine.pid
        self._update_tray()
        if state is EngineState.READY:
            self.crash_panel.hide()
            self.clear_notice("restart")
            self.poller.poll()
            self.live.fetch_cache_config()
        if state is EngineState.STARTING:
            self.monitor.engine_restarted()
            self.conversation_rows = None  # the earlier run's, not this one's

    def _on_ended(self, outcome: ProcessOutcome) -> None:
        if outcome.clean or self._quitting:
            return
        # The last line is the supervisor's own "the engine ..." summary: the panel says it in words above.
        rows = self.conversation_rows
        lost = "" if outcome.config_error or rows is None else cache_loss(
            rows, time.monotonic() - self.conversations_at).describe()
        text = self.crash_panel.show_outcome(outcome, list(self.engine.lines)[:-1], lost,
                                             memory_note(outcome, self.memory))
        busy = busy_port(outcome.config_error)
        if busy:
            self.dispatcher.submit(lambda: port_owner(busy.port), lambda owner: self._got_port_owner(busy, owner))
        self.monitor.set_engine_state(self.engine.state, text if outcome.config_error else "")
        if not self.isVisible():
            self.tray.notify("Strata engine stopped", f"{text} {lost}".strip())

    def _got_port_owner(self, busy: BusyPort, owner: Any) -> None:
        """The program holding the port, found off the GUI thread: name it in the panel (unless a newer run ended)."""
        outcome = self.engine.outcome
        if isinstance(owner, BaseException) or outcome is None or busy_port(outcome.config_error) != busy:
            return
        text = describe_busy_port(busy, owner)
        self.crash_text.setText(text)
        self.monitor.set_engine_state(self.engine.state, text)
        self.app_line(text)

    def open_setting(self, name: str) -> None:
        """Show the Settings tab with the keyboard in one setting's field."""
        self.tabs.setCurrentWidget(self.settings_tab)
        self.settings_tab.focus_setting(name)

    def _open_failed_setting(self) -> None:
        self.open_setting(setting_for_error(self.engine.outcome.config_error if self.engine.outcome else ""))

    # ------------------------------------------------------------------ polling results

    @property
    def conversations(self) -> list[ParkedConversation] | None:
        """The last listing merged one row per conversation, whichever tiers and ids hold it (the Monitor learns
        from the event log which ids are one conversation, maybe after the listing came)."""
        rows = self.conversation_rows
        return None if rows is None else merge_tiers(rows, self.monitor.model.links)

    def cache_snapshot(self) -> tuple[list[ParkedConversation], MetricsBody | None]:
        """The engine's last reported conversations (one row each) and metrics: what purge and eviction see."""
        return self.conversations or [], self.metrics

    def _on_memory(self, sample: MemorySample) -> None:
        self.memory = sample
        self.monitor.set_memory(sample)

    def _on_metrics(self, metrics: MetricsBody) -> None:
        self.metrics = metrics
        self.monitor.clear_unreachable()
        self.monitor.set_metrics(metrics)
        self.settings_tab.set_expert_arena(metrics.engine.expert_arena_bytes)
        self.live.follow()  # a live setting changed by another client of the engine's API
        self._update_tray()

    def _on_conversations(self, rows: list[ConversationRow]) -> None:
        self.conversation_rows, self.conversations_at = rows, time.monotonic()
        self.monitor.set_conversations(rows)
        self._update_tray()

    def _monitor_visible(self, visible: bool) -> None:
        self.poller.detail = visible
        self.poller.set_interval(DETAIL_INTERVAL_MS if visible else BACKGROUND_INTERVAL_MS)
        if visible:
            self.poller.poll()

    def _update_tray(self) -> None:
        ready = self.engine.state is EngineState.READY
        parked = len(self.conversations) if (ready and self.conversations is not None) else None
        health = self.engine.health
        self.tray.update_status(self.engine.state, self.metrics if ready else None, parked,
                                describe(health) if health is not None else "", self.engine.state_text)

    # ------------------------------------------------------------------ settings

    def _prefs_changed(self) -> None:
        self.engine.auto_restart = self.store.prefs.auto_restart
        if not self.store.prefs.auto_restart:
            self.engine.cancel_auto_restart()
            self.clear_notice("restart")

    # ------------------------------------------------------------------ purge

    def _purge_from_tray(self) -> None:
        self.show_window()
        self.tabs.setCurrentWidget(self.monitor)
        self.purger.request("all")

    # ------------------------------------------------------------------ window, tray, quit

    def app_line(self, text: str) -> None:
        """One line from the app itself, in the Logs tab and in desktop.log."""
        line = APP_PREFIX + text
        self.logs.append_line(line)
        self.log_files.write_line(line)

    def show_notice(self, text: str, kind: str = "info") -> None:
        """The banner above the tabs; `kind` says which event may take it down again (clear_notice)."""
        self.notice_kind = kind
        self.notice.setText(text)
        self.notice.show()

    def clear_notice(self, kind: str) -> None:
        """Hide the banner if it still shows a notice of `kind` (a newer one of another kind stays)."""
        if self.notice_kind == kind:
            self.notice.hide()
            self.notice.clear()
            self.notice_kind = None

    def show_window(self) -> None:
        self.show()
        self.setWindowState((self.windowState() & ~Qt.WindowState.WindowMinimized) | Qt.WindowState.WindowActive)
        self.raise_()
        self.activateWindow()

    def closeEvent(self, event: QCloseEvent) -> None:
        if self._quitting:
            event.accept()
            return
        # Only a shown window's close can be a person's click on its close button (close to the tray); a hidden
        # one's is the system or a program asking the app to end (on Windows: WM_CLOSE from taskkill without /F,
        # an uninstaller, Task Manager's "End task").
        if self.isVisible() and self.use_tray and self.store.prefs.close_to_tray and tray_available():
            event.ignore()
            self.hide()
            if not self.store.prefs.tray_notice_shown:
                self.tray.notify("Strata keeps serving",
                                 "The engine keeps running in the background. Use the tray icon to open the "
                                 "window or to quit. (Settings → Desktop app changes this.)")
                self.store.set_pref("tray_notice_shown", True)
                self.autosaver.schedule()
            return
        event.ignore()
        self.quit()

    def request_quit(self) -> bool:
        """A request from Qt or the platform to end the event loop: True once the clean quit is done; until then
        it starts that quit (`quit`), which ends the loop itself."""
        if self._finished:
            return True
        self.quit()
        return False

    def quit(self) -> None:
        """Save settings, stop the engine cleanly (it may spill its cache), then leave the event loop."""
        if self._quitting:
            return
        self._quitting = True
        self.settings_tab.settle_now()
        self.autosaver.flush()
        self.hide()
        self.engine.cancel_restarts()  # a restart under way included: no engine may start after the quit
        if self.engine.running:
            self.tray.icon.setToolTip("Strata — stopping the engine…")
            self.engine.ended.connect(lambda _o: self._finish_quit())
            self.engine.stop()
            # Safety net: the engine's own deadlines end it; this only guards against a stuck process.
            deadline = self.engine.shutdown_grace_s + 10
            QTimer.singleShot(int(deadline * 1000), self._finish_quit)
        else:
            QTimer.singleShot(0, self._finish_quit)

    def _finish_quit(self) -> None:
        if self._finished:
            return
        self._teardown()
        self.quit_finished.emit()
        app = QApplication.instance()
        if app is not None:
            app.quit()

    def shutdown_now(self) -> None:
        """Synchronous teardown for tests and aboutToQuit: the engine's clean stop, waited for here, and nothing
        else may keep running."""
        if self._finished:
            return
        self._quitting = True
        self.autosaver.flush()
        self._teardown()

    def _teardown(self) -> None:
        """End everything the window runs: no engine, thread, timer or open file outlives it."""
        self._finished = True
        self.chat.shutdown()
        self.engine.cancel_restarts()  # a restart waiting for the old engine to stop must not start a new one
        self.engine.stop_and_wait()
        self.engine.close()
        self.poller.stop()
        self.tray.hide()
        self.dispatcher.close(wait=True)
        self.chat_keeper.flush(self.chat.kept())  # after the pool: no older background write lands after it
        self.client.close()
        self.log_files.close()


def default_size(available: QSize) -> tuple[int, int]:
    """The first window size: DEFAULT_SIZE, shrunk to fit the screen's free area (a 1366x768 laptop included)."""
    width = min(DEFAULT_SIZE[0], available.width() - 40)
    height = min(DEFAULT_SIZE[1], available.height() - 60)  # room for the title bar and a panel
    return max(width, MINIMUM_SIZE[0]), max(height, MINIMUM_SIZE[1])
