"""The panel shown above the tabs when the engine stopped without being asked: the reason, the log tail, actions.

Its height is fixed: the log tail scrolls (both ways) inside a read-only view, so a long traceback never grows
the window past the screen.
"""

from __future__ import annotations

from collections.abc import Sequence

from PySide6.QtCore import Qt
from PySide6.QtGui import QFont, QFontMetrics
from PySide6.QtWidgets import (
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QSizePolicy,
    QVBoxLayout,
    QWidget,
)

from desktop.engine_errors import busy_port, describe_busy_port, describe_config_error
from desktop.engine_process import ProcessOutcome

TAIL_LINES = 40  # lines of the engine's output kept in the panel (it scrolls)
VISIBLE_LINES = 5  # lines visible at once


class CrashPanel(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("crashPanel")
        self.setAttribute(Qt.WidgetAttribute.WA_StyledBackground, True)
        self.setStyleSheet("QWidget#crashPanel { background: #ffebee; border: 1px solid #ef9a9a;"
                           " border-radius: 3px; }")
        self.text = QLabel()
        self.text.setWordWrap(True)
        self.text.setTextFormat(Qt.TextFormat.PlainText)
        self.text.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        font = self.text.font()
        font.setBold(True)
        self.text.setFont(font)
        self.cache_text = QLabel()  # what the crash cost the conversation cache (lost in RAM, kept on disk)
        self.cache_text.setObjectName("crashCache")
        self.cache_text.setWordWrap(True)
        self.cache_text.setTextFormat(Qt.TextFormat.PlainText)
        self.cache_text.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.cache_text.hide()
        self.log = QPlainTextEdit()
        self.log.setObjectName("crashLog")
        self.log.setReadOnly(True)
        self.log.setLineWrapMode(QPlainTextEdit.LineWrapMode.NoWrap)
        mono = QFont("monospace")
        mono.setStyleHint(QFont.StyleHint.Monospace)
        self.log.setFont(mono)
        self.log.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Fixed)
        self.log.setFixedHeight(VISIBLE_LINES * QFontMetrics(mono).lineSpacing() + 12)
        self.settings_button = QPushButton("Open Settings")
        self.settings_button.hide()
        self.restart_button = QPushButton("Restart")
        self.logs_button = QPushButton("Show logs")
        report = QVBoxLayout()
        report.addWidget(self.text)
        report.addWidget(self.cache_text)
        report.addWidget(self.log)
        buttons = QVBoxLayout()
        buttons.addWidget(self.settings_button)
        buttons.addWidget(self.restart_button)
        buttons.addWidget(self.logs_button)
        buttons.addStretch(1)
        layout = QHBoxLayout(self)
        layout.addLayout(report, 1)
        layout.addLayout(buttons)
        self.hide()

    def show_outcome(self, outcome: ProcessOutcome, lines: Sequence[str], cache: str = "", note: str = "") -> str:
        """Show why the engine ended (with `note`, e.g. the host was out of memory), what the conversation cache
        lost and kept (`cache`, "" when unknown or beside the point) and the lines before; returns the text."""
        reason = outcome.config_error
        if reason:
            busy = busy_port(reason)
            text = describe_busy_port(busy, None) if busy else describe_config_error(reason)
        else:
            text = f"The engine {outcome.describe()}." + (f" {note}" if note else "")
        self.text.setText(text)
        self.cache_text.setText(cache)
        self.cache_text.setVisible(bool(cache))
        # A refused setting fails the same way again: the way out is Settings, and a retry is only a retry.
        self.settings_button.setVisible(bool(reason))
        self.restart_button.setText("Try again" if reason else "Restart")
        self.log.setPlainText("\n".join(list(lines)[-TAIL_LINES:]))
        self.log.verticalScrollBar().setValue(self.log.verticalScrollBar().maximum())
        self.show()
        return text
