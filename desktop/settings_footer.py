"""The bottom of the Settings tab: the engine's command line for these settings (with Copy, and how it gets the
secrets it does not show), what is pending, the buttons that act on it (Apply, Revert, Restart engine) and the
last apply's outcome. The tab decides what they say and do; this module lays them out and renders the command.
"""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPushButton, QVBoxLayout, QWidget

from desktop.settings import SettingsStore, command_line, secret_variables, set_variable_hint
from desktop.widgets import CommandView
from engine.setting import SettingError


class SettingsFooter(QWidget):
    """The command line of `store`'s settings and the tab's pending line, buttons and outcome."""

    def __init__(self, store: SettingsStore, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.store = store
        self.command = CommandView()
        self.copy_button = QPushButton("Copy")
        self.copy_button.setToolTip("Copy the command line to the clipboard (a key stays out of it: the line "
                                    "reads it from an environment variable)")
        self.command_note = QLabel()  # how the shown line gets the secrets it does not show
        self.command_note.setWordWrap(True)
        self.copy_button.clicked.connect(self.copy_command)
        self.pending = QLabel()
        self.pending.setWordWrap(True)
        self.apply_button = QPushButton("Apply")
        self.apply_button.setToolTip("Send the live settings to the running engine again (after a refusal or a "
                                     "declined eviction); a settled edit is applied without it")
        self.revert_button = QPushButton("Revert")
        self.revert_button.setToolTip("Go back to the values the running engine uses")
        self.restart_button = QPushButton("Restart engine")
        self.result = QLabel()
        self.result.setWordWrap(True)
        bl = QVBoxLayout(self)
        bl.setContentsMargins(0, 0, 0, 0)
        # The lines whose length changes (an apply's outcome, what is pending, the note on secrets) sit above the
        # command line, which has a fixed height and is anchored to the window's bottom edge: growing text
        # pushes the page above up, never the Copy button from under the pointer.
        bl.addWidget(self.result)
        act_row = QHBoxLayout()
        act_row.addWidget(self.pending, 1)
        for button in (self.apply_button, self.revert_button, self.restart_button):
            act_row.addWidget(button, 0, Qt.AlignmentFlag.AlignBottom)
        bl.addLayout(act_row)
        bl.addWidget(self.command_note)
        cmd_row = QHBoxLayout()
        cmd_row.addWidget(QLabel("Command line:"))
        cmd_row.addWidget(self.command, 1)
        cmd_row.addWidget(self.copy_button, 0, Qt.AlignmentFlag.AlignTop)
        bl.addLayout(cmd_row)

    def show_command(self) -> None:
        """The command line of the stored settings, and how it gets the keys it leaves out."""
        try:
            config = self.store.engine_config()
            self.command.setText(command_line(config))
            names = secret_variables(config)
            self.command_note.setText("Before pasting it into a shell, set " + " and ".join(
                f"{n} to the key ({set_variable_hint(n)})" for n in names) + "." if names else "")
            self.command_note.setVisible(bool(names))
        except SettingError as e:  # the store refuses such values; shown rather than hidden if it happens
            self.command.setText(str(e))

    def copy_command(self) -> None:
        """Put the command line of the stored settings on the clipboard."""
        QGuiApplication.clipboard().setText(command_line(self.store.engine_config()))
