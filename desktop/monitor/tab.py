"""The Monitor tab: memory plots, park/restore timings, counters, the parked-conversations table with each one's
priority and pin (and the control to change them), Purge, and the request log (every request explained; a
selected conversation's requests are its reuse history)."""

from __future__ import annotations

import time
from typing import Any

from PySide6.QtCore import QSize, QSortFilterProxyModel, Qt, Signal
from PySide6.QtGui import QAction, QHideEvent, QShowEvent
from PySide6.QtWidgets import (
    QAbstractItemView,
    QFrame,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QMenu,
    QScrollArea,
    QSplitter,
    QTableView,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from desktop.client import MemorySample
from desktop.engine_process import EngineState
from desktop.monitor.conversation_controls import ConversationControls
from desktop.monitor.conversations import SORT_ROLE, ConversationsModel, ParkedConversation
from desktop.monitor.counters import CountersPanel
from desktop.monitor.lineage import learn_links
from desktop.monitor.requests import RequestLogPanel
from engine.contract import ConversationRow, Event, MetricsBody, RequestRecord

UNREACHABLE_AFTER = 3  # missed polls in a row before the "did not answer" banner shows
CONTENT_MINIMUM_WIDTH = 720  # plots and counters readable side by side; a narrower window scrolls
TABLE_MINIMUM_ROWS = 4  # parked conversations always visible without scrolling the tab (1366x768 showed 1.3)


class CountersScroll(QScrollArea):
    """The counters, scrolled on their own when short of height: their full height (~500 px) as the top row's
    minimum pushed the parked list below the fold. As wide as the counters need, so none is cut off."""

    def minimumSizeHint(self) -> QSize:
        inner = self.widget().minimumSizeHint() if self.widget() is not None else QSize(0, 0)
        return QSize(inner.width() + self.verticalScrollBar().sizeHint().width() + 2, 120)


def rows_height(table: QTableView, rows: int) -> int:
    """The height a table needs to show its header and `rows` rows, with room for a horizontal scroll bar."""
    return (table.horizontalHeader().sizeHint().height() + rows * table.verticalHeader().defaultSectionSize()
            + table.horizontalScrollBar().sizeHint().height() + 2 * table.frameWidth())


class MonitorTab(QWidget):
    """Renders what the engine reports; greyed, with its last figures, while the engine is not ready."""

    purge_requested = Signal(str)  # "ram" | "disk" | "all"
    conversation_change_requested = Signal(str, dict)  # id, {"priority": ...} or {"pinned": ...}
    conversation_drop_requested = Signal(str)  # id
    visibility_changed = Signal(bool)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.banner = QLabel()
        self.banner.setObjectName("monitorBanner")
        self.banner.setWordWrap(True)
        self.banner.setStyleSheet("QLabel#monitorBanner { background: #fff3cd; color: #5c4400; padding: 6px;"
                                  " border: 1px solid #e6d08a; border-radius: 3px; }")
        # The plots (pyqtgraph, numpy) are built after the window's first paint: see ensure_plots().
        self.memory: Any = None  # MemoryPlots
        self.timings: Any = None  # TimingPlot
        self._pending_samples: list[MemorySample] = []
        self._events: list[Event] = []
        self._floor: float | None = None
        self._arena = 0  # expert arena bytes (engine.expert_arena_bytes)
        self.counters = CountersPanel()
        self.model = ConversationsModel(self)
        self.proxy = QSortFilterProxyModel(self)
        self.proxy.setSourceModel(self.model)
        self.proxy.setSortRole(SORT_ROLE)
        self.table = QTableView()
        self.table.setModel(self.proxy)
        self.table.setSortingEnabled(True)
        self.table.sortByColumn(5, Qt.SortOrder.AscendingOrder)  # most recently used first
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.verticalHeader().setVisible(False)
        self.table.setAlternatingRowColors(True)
        self.table.setMinimumHeight(rows_height(self.table, TABLE_MINIMUM_ROWS))
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        for col in range(1, len(ConversationsModel.COLUMNS)):
            header.setSectionResizeMode(col, QHeaderView.ResizeMode.ResizeToContents)
        self.table_title = QLabel("<b>Parked conversations</b>")
        self.purge_button = QToolButton()
        self.purge_button.setText("Purge…")
        self.purge_button.setToolTip("Drop parked conversations from RAM, disk or both")
        self.purge_button.setPopupMode(QToolButton.ToolButtonPopupMode.InstantPopup)
        menu = QMenu(self.purge_button)
        self.purge_actions: dict[str, QAction] = {}
        for tier, text in (("ram", "Purge RAM tier…"), ("disk", "Purge disk tier…"), ("all", "Purge everything…")):
            action = menu.addAction(text)
            action.triggered.connect(lambda _=False, t=tier: self.purge_requested.emit(t))
            self.purge_actions[tier] = action
        self.purge_button.setMenu(menu)
        self.controls = ConversationControls()
        self.controls.change_requested.connect(self.conversation_change_requested)
        self.controls.drop_requested.connect(self.conversation_drop_requested)
        self.table.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.table.customContextMenuRequested.connect(self._conversation_menu)
        self.table.selectionModel().selectionChanged.connect(lambda *_: self._selection_changed())
        self.requests = RequestLogPanel()
        self.requests.show_all_requested.connect(self.table.clearSelection)

        table_box = QWidget()
        tl = QVBoxLayout(table_box)
        tl.setContentsMargins(0, 0, 0, 0)
        head = QHBoxLayout()
        head.addWidget(self.table_title)
        head.addStretch(1)
        head.addWidget(self.purge_button)
        tl.addLayout(head)
        tl.addWidget(self.table)
        tl.addWidget(self.controls)

        self.plots = QWidget()
        self._plots_layout = QVBoxLayout(self.plots)
        self._plots_layout.setContentsMargins(0, 0, 0, 0)
        self._plots_placeholder = QLabel("Preparing plots…")
        self._plots_placeholder.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self._plots_layout.addWidget(self._plots_placeholder)
        top = QSplitter(Qt.Orientation.Horizontal)
        self.counters_scroll = CountersScroll()
        self.counters_scroll.setWidgetResizable(True)
        self.counters_scroll.setFrameShape(QFrame.Shape.NoFrame)
        self.counters_scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.counters_scroll.setWidget(self.counters)
        top.addWidget(self.plots)
        top.addWidget(self.counters_scroll)
        top.setStretchFactor(0, 3)
        top.setStretchFactor(1, 2)
        self.splitter = QSplitter(Qt.Orientation.Vertical)
        self.splitter.addWidget(top)
        self.splitter.addWidget(table_box)
        self.splitter.addWidget(self.requests)
        self.splitter.setStretchFactor(0, 3)
        self.splitter.setStretchFactor(1, 1)
        self.splitter.setStretchFactor(2, 1)
        # Below its comfortable size the content scrolls instead of squeezing rows into each other.
        self.scroll = QScrollArea()
        self.scroll.setObjectName("monitorScroll")
        self.scroll.setWidgetResizable(True)
        self.scroll.setFrameShape(QFrame.Shape.NoFrame)
        self.splitter.setMinimumWidth(CONTENT_MINIMUM_WIDTH)  # its height floor: its parts' minimum heights
        self.scroll.setWidget(self.splitter)
        layout = QVBoxLayout(self)
        layout.addWidget(self.banner)
        layout.addWidget(self.scroll, 1)

        self.conversation_menu: QMenu | None = None
        self.metrics: MetricsBody | None = None
        self.conversation_rows: list[ConversationRow] = []
        self.last_update: float | None = None
        self.missed_polls = 0  # /metrics polls in a row without an answer
        self.state = EngineState.STOPPED
        self.set_engine_state(EngineState.STOPPED)

    def ensure_plots(self) -> None:
        """Build the plots (imports pyqtgraph) and replay what arrived before; cheap once built."""
        if self.memory is not None:
            return
        from desktop.monitor.plots import MemoryPlots, TimingPlot

        self.memory, self.timings = MemoryPlots(), TimingPlot()
        self.memory.set_arena(self._arena)  # before the replay: samples take the arena known when they are added
        self._plots_layout.removeWidget(self._plots_placeholder)
        # Hidden now, deleted later: out of the layout it still paints where it was until the event loop deletes
        # it (the Windows build's first screenshot showed it through the plots).
        self._plots_placeholder.hide()
        self._plots_placeholder.deleteLater()
        self._plots_layout.addWidget(self.memory, 2)
        self._plots_layout.addWidget(self.timings, 1)
        for sample in self._pending_samples:
            self.memory.add_sample(sample)
        self._pending_samples.clear()
        self.memory.set_floor(self._floor)
        self.timings.set_events(self._events)
        self.set_engine_state(self.state)
        if self.isVisible():
            self.memory.redraw()
            self.timings.redraw()

    # ------------------------------------------------------------------ data in

    def set_memory(self, sample: MemorySample) -> None:
        if self.memory is None:
            self._pending_samples = [*self._pending_samples[-600:], sample]
            return
        self.memory.add_sample(sample)
        if self.isVisible():
            self.memory.redraw()

    def set_metrics(self, metrics: MetricsBody) -> None:
        self.metrics = metrics
        self.last_update = time.time()
        self._floor = float(metrics.conversation_cache.min_free_bytes)
        self._arena = metrics.engine.expert_arena_bytes
        if self.memory is not None:
            self.memory.set_floor(self._floor)
            self.memory.set_arena(self._arena)
        self.counters.set_metrics(metrics)
        self._update_counts()

    def set_conversations(self, rows: list[ConversationRow]) -> None:
        """The engine's rows (one per tier and id), shown one per conversation."""
        self.conversation_rows = rows
        learn_links(self._events, rows, self.model.links)
        selected = self.selected_conversation()
        before = None if selected is None else selected.id
        self.model.set_rows(rows)
        self.counters.set_parked(len(self.model.rows))
        if before is not None and self.selected_conversation() is None:
            self._select(before)  # a new conversation in the list must not take the selection away
        selected = self.selected_conversation()
        if selected is not None or self.controls.row is not None:
            self.controls.set_conversation(selected)  # its priority and pin as the engine lists them now

    def _select(self, conversation_id: str) -> None:
        for i, row in enumerate(self.model.rows):
            if conversation_id in row.ids:  # a merged row answers to each of its ids
                self.table.selectRow(self.proxy.mapFromSource(self.model.index(i, 0)).row())
                return
        self._update_counts()

    def set_requests(self, records: list[RequestRecord]) -> None:
        self.requests.set_records(records)

    def selected_conversation(self) -> ParkedConversation | None:
        rows = self.table.selectionModel().selectedRows()
        if not rows:
            return None
        source = self.proxy.mapToSource(rows[0])
        return self.model.rows[source.row()] if 0 <= source.row() < len(self.model.rows) else None

    def _selection_changed(self) -> None:
        """The selected conversation's priority and pin in the controls, and its requests in the log."""
        row = self.selected_conversation()
        self.controls.set_conversation(row)
        if row is None:
            self.requests.set_conversation(None)
        else:
            self.requests.set_conversation(row.id, row.name)

    def _conversation_menu(self, pos: Any) -> None:
        if self.selected_conversation() is None:
            return
        menu = QMenu(self.table)
        self.controls.add_actions(menu)
        menu.popup(self.table.viewport().mapToGlobal(pos))
        self.conversation_menu = menu  # kept for tests and so it outlives this call

    def set_events(self, events: list[Event]) -> None:
        self._events = events
        self.counters.set_events(events)
        if learn_links(events, self.conversation_rows, self.model.links):
            self.set_conversations(self.conversation_rows)  # a restored conversation parked again: one row
        if self.timings is not None:
            self.timings.set_events(events)
            if self.isVisible():
                self.timings.redraw()

    def engine_restarted(self) -> None:
        """A new engine process: its park/restore history starts empty, on a new time axis."""
        self._events = []
        self.counters.set_events([])
        if self.timings is not None:
            self.timings.reset()

    def set_conversations_error(self, message: str) -> None:
        """The engine could not list its conversations: say so above the (last known) table."""
        self.table_title.setText(f"<b>Parked conversations</b> — the engine did not list them: {_escape(message)}")
        self.counters.set_parked(None)

    def _update_counts(self) -> None:
        n = len(self.conversation_rows)
        self.table_title.setText(f"<b>Parked conversations</b> ({n})")

    # ------------------------------------------------------------------ state

    def set_engine_state(self, state: EngineState, detail: str = "") -> None:
        """Ready: live. Otherwise greyed with the reason and the time of the last figures."""
        self.state = state
        live = state is EngineState.READY
        for w in (self.counters, self.table, self.timings, self.memory and self.memory.engine_plot):
            if w is not None:
                w.setEnabled(live)
        self.purge_button.setEnabled(live)
        self.controls.setEnabled(live)
        self.requests.table.setEnabled(live)
        if live:
            self.banner.hide()
            return
        text = {
            EngineState.STOPPED: "The engine is stopped.",
            EngineState.STARTING: "The engine is starting…",
            EngineState.LOADING: "The engine is loading the model…",
            EngineState.STOPPING: "The engine is stopping…",
            EngineState.CRASHED: "The engine stopped unexpectedly.",
        }[state]
        if detail:
            # A crash with a known reason (a refused setting) says that instead of "unexpectedly".
            text = detail if state is EngineState.CRASHED else f"{text} {detail}"
        if self.last_update is not None:
            text += f" Figures below are from {time.strftime('%H:%M:%S', time.localtime(self.last_update))}."
        self.banner.setText(text)
        self.banner.show()

    def set_unreachable(self, reason: str) -> None:
        """The engine is running but did not answer /metrics: said after UNREACHABLE_AFTER misses in a row.

        One slow answer (a long generation step) is normal; a banner blinking on and off with each would move
        everything below it under the pointer.
        """
        self.missed_polls += 1
        if self.state is EngineState.READY and self.missed_polls >= UNREACHABLE_AFTER:
            self.banner.setText(f"The engine did not answer: {reason}. Showing the last figures.")
            self.banner.show()

    def clear_unreachable(self) -> None:
        self.missed_polls = 0
        if self.state is EngineState.READY:
            self.banner.hide()

    # ------------------------------------------------------------------ visibility

    def showEvent(self, event: QShowEvent) -> None:
        super().showEvent(event)
        if self.memory is not None:
            self.memory.redraw()
            self.timings.redraw()
        self.visibility_changed.emit(True)

    def hideEvent(self, event: QHideEvent) -> None:
        super().hideEvent(event)
        self.visibility_changed.emit(False)


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
