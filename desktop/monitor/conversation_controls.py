"""The selected parked conversation's priority and pin, and the control that changes them.

A priority combo and a Pinned check box act on the conversation selected in the table (the table's context menu
offers the same); each change is a `change_requested(id, {"priority": ...} | {"pinned": ...})` that the window
sends as PATCH /cache/conversations/{id}; "Drop…" is a `drop_requested(id)` the window asks about, then sends as
DELETE /cache/conversations/{id}. The engine's answer, or its refusal in its own words, shows beside them.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QCheckBox, QComboBox, QHBoxLayout, QLabel, QMenu, QPushButton, QWidget

from desktop.monitor.conversations import ParkedConversation

PRIORITY_LABELS = (("high", "High priority"), ("normal", "Normal priority"), ("low", "Low priority"))


def conversation_title(row: ParkedConversation) -> str:
    return row.name or row.id or "?"


class ConversationControls(QWidget):
    change_requested = Signal(str, dict)
    drop_requested = Signal(str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.row: ParkedConversation | None = None
        self.selected = QLabel("Select a conversation to change its priority or pin it.")
        self.priority = QComboBox()
        for value, text in PRIORITY_LABELS:
            self.priority.addItem(text, value)
        self.priority.setToolTip("Budgets evict low before normal before high; a lower-priority park never "
                                 "evicts a higher-priority conversation")
        self.pinned = QCheckBox("Pinned")
        self.pinned.setToolTip("A pinned conversation is evicted only when nothing unpinned is left")
        self.drop = QPushButton("Drop…")
        self.drop.setToolTip("Drop this conversation from the cache (RAM and disk); its next turn is computed again")
        self.drop.clicked.connect(self._drop)
        self.result = QLabel()
        self.result.setObjectName("conversationResult")
        self.result.setWordWrap(True)
        self.priority.activated.connect(self._priority_chosen)
        self.pinned.clicked.connect(lambda checked: self._request({"pinned": bool(checked)}))
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.selected, 1)
        layout.addWidget(self.priority)
        layout.addWidget(self.pinned)
        layout.addWidget(self.drop)
        layout.addWidget(self.result, 2)
        self.set_conversation(None)

    def set_conversation(self, row: ParkedConversation | None) -> None:
        """Show the selected conversation's priority and pin (as the engine last listed them); None = none."""
        changed = (None if row is None else row.id) != (None if self.row is None else self.row.id)
        self.row = row
        self.priority.setEnabled(row is not None)
        self.pinned.setEnabled(row is not None)
        self.drop.setEnabled(row is not None)
        if changed and row is not None:  # another conversation: its own result; none selected: keep the last
            self.result.clear()
        if row is None:
            self.selected.setText("Select a conversation to change its priority or pin it.")
            return
        self.selected.setText(f"<b>{conversation_title(row).replace('<', '&lt;')}</b>")
        self.priority.setCurrentIndex(max(self.priority.findData(row.priority), 0))
        self.pinned.setChecked(row.pinned)

    def add_actions(self, menu: QMenu) -> None:
        """The same choices as a context menu for the selected conversation."""
        if self.row is None:
            return
        current = self.row.priority
        for value, text in PRIORITY_LABELS:
            action = menu.addAction(text)
            action.setCheckable(True)
            action.setChecked(value == current)
            action.triggered.connect(lambda _=False, v=value: self._request({"priority": v}))
        menu.addSeparator()
        pinned = self.row.pinned
        pin = menu.addAction("Unpin" if pinned else "Pin")
        pin.triggered.connect(lambda _=False: self._request({"pinned": not pinned}))
        menu.addSeparator()
        menu.addAction("Drop…").triggered.connect(lambda _=False: self._drop())

    def show_result(self, text: str, *, error: bool) -> None:
        self.result.setStyleSheet("color: #a00000;" if error else "")
        self.result.setText(text)

    def _priority_chosen(self, index: int) -> None:
        value = self.priority.itemData(index)
        if self.row is not None and value != self.row.priority:
            self._request({"priority": value})

    def _drop(self) -> None:
        if self.row is not None:
            self.drop_requested.emit(self.row.id)

    def _request(self, changes: dict[str, Any]) -> None:
        if self.row is not None:
            self.result.setStyleSheet("")
            self.result.setText("Asking the engine…")
            self.change_requested.emit(self.row.id, changes)
