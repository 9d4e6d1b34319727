"""The Settings tab's "Desktop app" group: the app's own preferences (start the engine with the app, close to the
tray, restart after a crash), start at login, and where the settings file is saved.

A preference is stored and saved as it is toggled; start at login is read and written off the UI thread (on
Windows it runs PowerShell), and a write that fails puts the box back and says why (`failed`).
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QCheckBox, QGroupBox, QLabel, QVBoxLayout, QWidget

from desktop.autostart import Autostart
from desktop.settings import AutoSaver, SettingsStore
from desktop.settings_captions import Submit

PREFS = (
    ("start_engine", "Start the engine when the app starts"),
    ("close_to_tray", "Closing the window keeps the engine serving from the tray"),
    ("auto_restart", "Restart the engine automatically if it crashes"),
)


class DesktopAppBox(QGroupBox):
    """The app's preferences, start at login and the settings file's place, as one group of the Settings tab."""

    prefs_changed = Signal()
    failed = Signal(str)  # a change that did not go through, in words

    def __init__(self, store: SettingsStore, autosaver: AutoSaver, submit: Submit,
                 autostart: Autostart | None = None, parent: QWidget | None = None) -> None:
        super().__init__("Desktop app", parent)
        self.store = store
        self.autosaver = autosaver
        self.autostart = autostart
        self._submit = submit
        app_layout = QVBoxLayout(self)
        self.pref_boxes: dict[str, QCheckBox] = {}
        for name, text in PREFS:
            cb = QCheckBox(text)
            cb.setChecked(getattr(store.prefs, name))
            cb.toggled.connect(lambda on, n=name: self._pref_toggled(n, on))
            app_layout.addWidget(cb)
            self.pref_boxes[name] = cb
        self.login_box = QCheckBox("Start at login, in the tray, serving")
        self.login_box.setEnabled(False)  # until the current state is read
        self.login_box.toggled.connect(self._login_toggled)
        if autostart is not None and autostart.supported:
            app_layout.addWidget(self.login_box)
            self._submit(autostart.load, self._got_login_state)
        self.file_label = QLabel(f"Saved automatically to {store.path}")
        self.file_label.setWordWrap(True)
        self.file_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.file_label.setStyleSheet("color: #666;")
        app_layout.addWidget(self.file_label)

    def reload(self) -> None:
        """Show the store's preferences again (after it was changed elsewhere), saving nothing."""
        for name, box in self.pref_boxes.items():
            box.blockSignals(True)
            box.setChecked(getattr(self.store.prefs, name))
            box.blockSignals(False)

    def _pref_toggled(self, name: str, on: bool) -> None:
        self.store.set_pref(name, on)
        self.autosaver.schedule()
        self.prefs_changed.emit()

    def _got_login_state(self, result: Any) -> None:
        self.login_box.blockSignals(True)
        self.login_box.setChecked(result is True)
        self.login_box.blockSignals(False)
        self.login_box.setEnabled(not isinstance(result, BaseException))

    def _login_toggled(self, on: bool) -> None:
        """Write or remove the start-at-login entry off the UI thread (on Windows it runs PowerShell)."""
        autostart = self.autostart
        assert autostart is not None
        self.login_box.setEnabled(False)

        def done(result: Any) -> None:
            self.login_box.setEnabled(True)
            if isinstance(result, BaseException):
                self.failed.emit(f"Could not change start at login: {result}")
                # what is on disk now, which a change that failed halfway may have left either way
                self._submit(autostart.is_enabled, self._got_login_state)

        self._submit(lambda: autostart.set_enabled(on), done)
