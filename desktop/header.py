"""The window's header: the engine's state, its start-up progress while it loads, the URL clients use, and the
Start / Stop / Restart buttons (enabled as the state allows)."""

from __future__ import annotations

import html

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPushButton, QSizePolicy, QWidget

from desktop.engine_process import EngineState
from desktop.startup_view import StartupView
from desktop.tray import STATE_COLORS


class EngineHeader(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.state_label = QLabel()
        self.state_label.setObjectName("engineState")
        # Said whole ("Not started: port 8080 is in use"): the URL and the start-up view's kept room give way first.
        self.state_label.setSizePolicy(QSizePolicy.Policy.Minimum, QSizePolicy.Policy.Preferred)
        self.startup = StartupView()  # the loading phase and its bar while the engine starts
        self.url_label = QLabel()
        self.url_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.start_button = QPushButton("Start engine")
        self.stop_button = QPushButton("Stop engine")
        self.restart_button = QPushButton("Restart engine")
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        for widget, stretch in ((self.state_label, 0), (self.startup, 0), (self.url_label, 1),
                                (self.start_button, 0), (self.stop_button, 0), (self.restart_button, 0)):
            layout.addWidget(widget, stretch)

    def set_state(self, state: EngineState, running: bool, words: str = "") -> None:
        """`running`: a process is up (it may be stopping); `words`: the state said otherwise than its label
        (a refused start: "Not started: port 8080 is in use")."""
        color = STATE_COLORS[state]
        self.state_label.setText(f"<b style='color:{color}'>●</b> Engine: <b>{html.escape(words or state.label)}</b>")
        settled = state is not EngineState.STOPPING
        self.start_button.setEnabled(not running and settled)
        self.stop_button.setEnabled(running and settled)
        self.restart_button.setEnabled(running and settled)
        self.startup.set_state(state)
        if state in (EngineState.STARTING, EngineState.STOPPED):
            self.url_label.setText("")

    def set_url(self, url: str | None) -> None:
        self.url_label.setText(f"{url}/v1" if url else "")
