"""The tray icon: engine status in a coloured badge and the tooltip; Open, Start/Stop engine, Purge cache, Quit."""

from __future__ import annotations

from PySide6.QtCore import QObject, QRectF, Qt, Signal
from PySide6.QtGui import QAction, QBrush, QColor, QIcon, QPainter, QPen, QPixmap
from PySide6.QtWidgets import QMenu, QSystemTrayIcon

from desktop.engine_process import EngineState
from desktop.settings import format_bytes
from engine.contract import MetricsBody

STATE_COLORS = {
    EngineState.STOPPED: "#757575", EngineState.STARTING: "#1565c0", EngineState.LOADING: "#1565c0",
    EngineState.READY: "#2e7d32", EngineState.STOPPING: "#ef6c00", EngineState.CRASHED: "#c62828",
}
BADGE_SIZES = (16, 22, 32, 48, 64)
BADGE_SHARE = 0.45  # the badge's diameter as a share of the icon: readable at 16 px


def badged_icon(base: QIcon, state: EngineState) -> QIcon:
    """`base` with a dot in the state's colour in its lower right corner: ready, starting, stopped, crashed at a
    glance in the tray, where the tooltip needs a hover."""
    color = QColor(STATE_COLORS[state])
    icon = QIcon()
    for size in BADGE_SIZES:
        pixmap = QPixmap(size, size)
        pixmap.fill(Qt.GlobalColor.transparent)
        painter = QPainter(pixmap)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        base.paint(painter, 0, 0, size, size)
        d = size * BADGE_SHARE
        painter.setPen(QPen(QColor("white"), max(1.0, size / 16)))
        painter.setBrush(QBrush(color))
        painter.drawEllipse(QRectF(size - d - 0.5, size - d - 0.5, d, d))
        painter.end()
        icon.addPixmap(pixmap)
    return icon


def tray_available() -> bool:
    return QSystemTrayIcon.isSystemTrayAvailable()


def tooltip_text(state: EngineState, metrics: MetricsBody | None, parked: int | None, loading: str = "",
                 words: str = "") -> str:
    """Strata — Ready · 3 parked · RAM 12.0 MiB · disk 0 B (or, loading: the start-up phase in words; `words`:
    the state said otherwise than its label, e.g. "Not started: port 8080 is in use")."""
    parts = [f"Strata — {(words or state.label).rstrip('…')}"]
    if state is EngineState.LOADING and loading:
        parts.append(loading)
    if state is EngineState.READY and metrics is not None:
        cache = metrics.conversation_cache
        if parked is not None:  # the count of /cache/conversations, once it came (a tiered conversation is one)
            parts.append(f"{parked} parked")
        parts.append(f"RAM {format_bytes(cache.bytes_ram)}")
        parts.append(f"disk {format_bytes(cache.bytes_disk)}")
    return " · ".join(parts)


class Tray(QObject):
    open_requested = Signal()
    start_requested = Signal()
    stop_requested = Signal()
    purge_requested = Signal()
    quit_requested = Signal()

    def __init__(self, icon: QIcon, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.menu = QMenu()
        self.open_action = QAction("Open Strata", self.menu)
        self.open_action.triggered.connect(self.open_requested)
        self.engine_action = QAction("Start engine", self.menu)
        self.engine_action.triggered.connect(self._toggle_engine)
        self.purge_action = QAction("Purge cache…", self.menu)
        self.purge_action.triggered.connect(self.purge_requested)
        self.quit_action = QAction("Quit", self.menu)
        self.quit_action.triggered.connect(self.quit_requested)
        self.menu.addAction(self.open_action)
        self.menu.addSeparator()
        self.menu.addAction(self.engine_action)
        self.menu.addAction(self.purge_action)
        self.menu.addSeparator()
        self.menu.addAction(self.quit_action)
        self.icons = {state: badged_icon(icon, state) for state in EngineState}  # drawn once, not per poll
        self.icon = QSystemTrayIcon(self.icons[EngineState.STOPPED], self)
        self.icon.setContextMenu(self.menu)
        self.icon.activated.connect(self._activated)
        self.state = EngineState.STOPPED
        self.update_status(EngineState.STOPPED, None, None)

    def show(self) -> None:
        self.icon.show()

    def hide(self) -> None:
        self.icon.hide()

    def update_status(self, state: EngineState, metrics: MetricsBody | None, parked: int | None,
                      loading: str = "", words: str = "") -> None:
        if state is not self.state:  # the tooltip changes every poll; the icon only with the state
            self.icon.setIcon(self.icons[state])
        self.state = state
        self.icon.setToolTip(tooltip_text(state, metrics, parked, loading, words))
        stoppable = state in (EngineState.STARTING, EngineState.LOADING, EngineState.READY)
        self.engine_action.setText("Stop engine" if stoppable else "Start engine")
        self.engine_action.setEnabled(state is not EngineState.STOPPING)
        self.purge_action.setEnabled(state is EngineState.READY)

    def notify(self, title: str, text: str) -> None:
        if self.icon.isVisible() and self.icon.supportsMessages():
            self.icon.showMessage(title, text, QSystemTrayIcon.MessageIcon.Information, 6000)

    def _toggle_engine(self) -> None:
        if self.state in (EngineState.STARTING, EngineState.LOADING, EngineState.READY):
            self.stop_requested.emit()
        else:
            self.start_requested.emit()

    def _activated(self, reason: QSystemTrayIcon.ActivationReason) -> None:
        if reason in (QSystemTrayIcon.ActivationReason.Trigger, QSystemTrayIcon.ActivationReason.DoubleClick):
            self.open_requested.emit()
