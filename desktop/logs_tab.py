"""The Logs tab: the engine's output as it arrives, bounded, searchable and copyable."""

from __future__ import annotations

from collections.abc import Iterable

from PySide6.QtGui import QFont, QGuiApplication, QTextCursor, QTextDocument
from PySide6.QtWidgets import (
    QCheckBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from desktop.engine_process import LOG_LINES


class LogsTab(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.view = QPlainTextEdit()
        self.view.setReadOnly(True)
        self.view.setMaximumBlockCount(LOG_LINES)  # bounded: old lines drop off the top
        self.view.setLineWrapMode(QPlainTextEdit.LineWrapMode.NoWrap)
        font = QFont("monospace")
        font.setStyleHint(QFont.StyleHint.Monospace)
        self.view.setFont(font)
        self.search = QLineEdit()
        self.search.setPlaceholderText("Search the log (Enter: next match)")
        self.search.setClearButtonEnabled(True)
        self.search.returnPressed.connect(self.find_next)
        self.search.textChanged.connect(self._search_changed)
        self.prev_button = QPushButton("Previous")
        self.prev_button.clicked.connect(self.find_previous)
        self.next_button = QPushButton("Next")
        self.next_button.clicked.connect(self.find_next)
        self.search_status = QLabel()
        self.follow = QCheckBox("Follow")
        self.follow.setChecked(True)
        self.follow.setToolTip("Keep the newest line in view")
        self.copy_button = QPushButton("Copy all")
        self.copy_button.clicked.connect(self.copy_all)
        self.clear_button = QPushButton("Clear")
        self.clear_button.clicked.connect(self.view.clear)

        bar = QHBoxLayout()
        bar.addWidget(self.search, 1)
        bar.addWidget(self.prev_button)
        bar.addWidget(self.next_button)
        bar.addWidget(self.search_status)
        bar.addStretch(0)
        bar.addWidget(self.follow)
        bar.addWidget(self.copy_button)
        bar.addWidget(self.clear_button)
        layout = QVBoxLayout(self)
        layout.addLayout(bar)
        layout.addWidget(self.view, 1)

    def append_line(self, text: str) -> None:
        scrollbar = self.view.verticalScrollBar()
        at_bottom = scrollbar.value() >= scrollbar.maximum() - 2
        cursor = QTextCursor(self.view.document())
        cursor.movePosition(QTextCursor.MoveOperation.End)
        if not self.view.document().isEmpty():
            cursor.insertBlock()
        cursor.insertText(text)
        if self.follow.isChecked() and at_bottom:
            scrollbar.setValue(scrollbar.maximum())

    def set_lines(self, lines: Iterable[str]) -> None:
        self.view.setPlainText("\n".join(lines))
        self.view.verticalScrollBar().setValue(self.view.verticalScrollBar().maximum())

    def text(self) -> str:
        return self.view.toPlainText()

    def copy_all(self) -> None:
        QGuiApplication.clipboard().setText(self.text())

    def _search_changed(self, _text: str) -> None:
        self.search_status.clear()

    def find_next(self) -> bool:
        return self._find(QTextDocument.FindFlag(0))

    def find_previous(self) -> bool:
        return self._find(QTextDocument.FindFlag.FindBackward)

    def _find(self, flags: QTextDocument.FindFlag) -> bool:
        needle = self.search.text()
        if not needle:
            return False
        self.follow.setChecked(False)
        if self.view.find(needle, flags):
            self.search_status.clear()
            return True
        # Wrap around once.
        cursor = self.view.textCursor()
        backward = bool(flags & QTextDocument.FindFlag.FindBackward)
        cursor.movePosition(QTextCursor.MoveOperation.End if backward else QTextCursor.MoveOperation.Start)
        self.view.setTextCursor(cursor)
        found = self.view.find(needle, flags)
        self.search_status.setText("" if found else "not found")
        return found
