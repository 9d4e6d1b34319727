"""The Logs tab: the engine's output as it arrives, bounded, searchable, filterable and copyable.

Every line is also in the log files (desktop/log_files.py); "Open log folder" shows them.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from pathlib import Path

from PySide6.QtCore import Qt, QUrl, Signal
from PySide6.QtGui import QDesktopServices, QFont, QGuiApplication, QTextCursor, QTextDocument
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
    folder_not_opened = Signal(str)  # nothing could show the log folder: the message, naming its path

    def __init__(self, log_dir: Path | None = None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.log_dir = log_dir
        self.lines: collections.deque[str] = collections.deque(maxlen=LOG_LINES)  # all lines, filtered or not
        self.matches = 0  # occurrences of the search text in `lines`
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
        self.search_status.setMinimumWidth(90)  # room for "1 234 matches": the bar does not shift as it counts
        self.filter = QCheckBox("Only matching lines")
        self.filter.toggled.connect(self._render)
        self.follow = QCheckBox("Follow")
        self.follow.setChecked(True)
        self.follow.setToolTip("Keep the newest line in view")
        self.follow.toggled.connect(self._follow_toggled)
        self.follow_off = QLabel("Follow is off: new lines are not scrolled into view")
        self.follow_off.setStyleSheet("color: #b26a00;")
        self.follow_off.hide()
        self.copy_button = QPushButton("Copy all")
        self.copy_button.clicked.connect(self.copy_all)
        self.clear_button = QPushButton("Clear")
        self.clear_button.clicked.connect(self.clear)
        self.folder_button = QPushButton("Open log folder")
        self.folder_button.setToolTip(f"The log files are in {log_dir}" if log_dir else "No log folder")
        self.folder_button.setEnabled(log_dir is not None)
        self.folder_button.clicked.connect(self.open_log_folder)

        # Said when nothing could open the folder (no file manager registered): where it is, to select or copy.
        self.folder_message = QLabel()
        self.folder_message.setObjectName("folderMessage")
        self.folder_message.setWordWrap(True)
        self.folder_message.setTextFormat(Qt.TextFormat.PlainText)
        self.folder_message.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse
                                                    | Qt.TextInteractionFlag.TextSelectableByKeyboard)
        self.folder_message.setStyleSheet("color: #b26a00;")
        self.copy_path_button = QPushButton("Copy path")
        self.copy_path_button.setToolTip("Copy the log folder's path to the clipboard")
        self.copy_path_button.clicked.connect(self.copy_log_path)
        self.folder_row = QWidget()
        folder_layout = QHBoxLayout(self.folder_row)
        folder_layout.setContentsMargins(0, 0, 0, 0)
        folder_layout.addWidget(self.folder_message, 1)
        folder_layout.addWidget(self.copy_path_button)
        self.folder_row.hide()
        self.folder_message.hide()

        bar = QHBoxLayout()
        bar.addWidget(self.search, 1)
        bar.addWidget(self.prev_button)
        bar.addWidget(self.next_button)
        bar.addWidget(self.search_status)
        bar.addWidget(self.filter)
        bar.addStretch(0)
        bar.addWidget(self.follow)
        bar.addWidget(self.copy_button)
        bar.addWidget(self.clear_button)
        bar.addWidget(self.folder_button)
        layout = QVBoxLayout(self)
        layout.addLayout(bar)
        layout.addWidget(self.folder_row)
        layout.addWidget(self.follow_off)
        layout.addWidget(self.view, 1)

    # ------------------------------------------------------------------ lines

    def _needle(self) -> str:
        return self.search.text().lower()

    def _filtering(self) -> bool:
        return self.filter.isChecked() and bool(self.search.text())

    def append_line(self, text: str) -> None:
        needle = self._needle()
        if needle:
            if len(self.lines) == self.lines.maxlen:
                self.matches -= self.lines[0].lower().count(needle)  # drops off the top
            self.matches += text.lower().count(needle)
            self._show_count()
        self.lines.append(text)
        if self._filtering() and needle not in text.lower():
            return
        self._insert(text)

    def _insert(self, text: str) -> None:
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
        self.lines.clear()
        self.lines.extend(lines)
        self._search_changed(self.search.text())

    def _render(self) -> None:
        """Show every line, or only the matching ones while the filter is on."""
        needle = self._needle()
        shown = [line for line in self.lines if needle in line.lower()] if self._filtering() else list(self.lines)
        self.view.setPlainText("\n".join(shown))
        self.view.verticalScrollBar().setValue(self.view.verticalScrollBar().maximum())

    def clear(self) -> None:
        self.lines.clear()
        self.view.clear()
        self._search_changed(self.search.text())

    def text(self) -> str:
        return self.view.toPlainText()

    def copy_all(self) -> None:
        QGuiApplication.clipboard().setText(self.text())

    def open_log_folder(self) -> bool:
        """Show the log folder in the file manager; where none opens it (none registered), say so with the
        folder's path to select or copy (here and through `folder_not_opened`, for the status bar)."""
        if self.log_dir is None:
            return False
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self._folder_not_opened(f"The log folder could not be created ({e.strerror}): {self.log_dir}")
            return False
        if QDesktopServices.openUrl(QUrl.fromLocalFile(str(self.log_dir))):
            self.folder_row.hide()
            self.folder_message.hide()
            return True
        self._folder_not_opened("Could not open the log folder (no file manager is set up to open folders). "
                                f"The log files are in {self.log_dir}")
        return False

    def _folder_not_opened(self, text: str) -> None:
        self.folder_message.setText(text)
        self.folder_message.show()
        self.folder_row.show()
        self.folder_not_opened.emit(text)

    def copy_log_path(self) -> None:
        QGuiApplication.clipboard().setText(str(self.log_dir) if self.log_dir is not None else "")

    # ------------------------------------------------------------------ search

    def _follow_toggled(self, on: bool) -> None:
        self.follow_off.setVisible(not on)
        if on:
            self.view.verticalScrollBar().setValue(self.view.verticalScrollBar().maximum())

    def _search_changed(self, _text: str) -> None:
        needle = self._needle()
        self.matches = sum(line.lower().count(needle) for line in self.lines) if needle else 0
        self._show_count()
        if self.filter.isChecked():
            self._render()

    def _show_count(self) -> None:
        if not self.search.text():
            self.search_status.clear()
            return
        n = self.matches
        self.search_status.setText("not found" if n == 0 else f"{n:,} match{'es' if n != 1 else ''}".replace(
            ",", "\u202f"))

    def find_next(self) -> bool:
        return self._find(QTextDocument.FindFlag(0))

    def find_previous(self) -> bool:
        return self._find(QTextDocument.FindFlag.FindBackward)

    def _find(self, flags: QTextDocument.FindFlag) -> bool:
        needle = self.search.text()
        if not needle:
            return False
        self.follow.setChecked(False)  # reading a match: new lines must not pull the view away
        if self.view.find(needle, flags):
            return True
        # Wrap around once.
        cursor = self.view.textCursor()
        backward = bool(flags & QTextDocument.FindFlag.FindBackward)
        cursor.movePosition(QTextCursor.MoveOperation.End if backward else QTextCursor.MoveOperation.Start)
        self.view.setTextCursor(cursor)
        found = self.view.find(needle, flags)
        if not found:
            self.search_status.setText("not found")
        return found

