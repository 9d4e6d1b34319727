"""The Settings tab: every engine setting from `engine.config`'s table, validated as you type, saved automatically.

Each row shows where its value comes from (default, settings file, environment) and whether it applies to a
running engine live or after a restart. Apply sends the live ones through `PUT /cache/config`; a restart is
offered for the rest, never forced.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import fields
from typing import Any

import psutil
from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QScrollArea,
    QVBoxLayout,
    QWidget,
)

from desktop.autostart import Autostart
from desktop.engine_process import EngineState
from desktop.folders import FolderReport, check_folder
from desktop.settings import (
    HIDDEN_SETTINGS,
    AutoSaver,
    SettingsStore,
    Source,
    command_line,
    format_bytes,
    format_mib,
    is_budget,
    parse_mib,
    secret_variables,
)
from desktop.settings_rows import FOLDER_SETTINGS, RowActions, SettingRow, build_row
from desktop.settings_words import GROUPS, arena_words, label_of, plain_error, risk_warning
from desktop.widgets import CommandView, guard_wheel
from engine.config import EngineConfig, SettingError, all_settings, default_cache_dir, setting_of

SETTLE_MS = 1200  # a pause in typing this long counts as done
PREFS = (
    ("start_engine", "Start the engine when the app starts"),
    ("close_to_tray", "Closing the window keeps the engine serving from the tray"),
    ("auto_restart", "Restart the engine automatically if it crashes"),
)


class SettingsTab(QWidget):
    apply_requested = Signal(dict)  # {field name: value} of live settings to send with PUT /cache/config
    restart_requested = Signal()
    prefs_changed = Signal()
    committed = Signal(str)  # a setting's editing settled (its value stored when valid)

    def __init__(self, store: SettingsStore, autosaver: AutoSaver,
                 submit: Callable[[Callable[[], Any], Callable[[Any], None]], None],
                 autostart: Autostart | None = None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.store = store
        self.autostart = autostart
        self.autosaver = autosaver
        self._submit = submit
        self.rows: dict[str, SettingRow] = {}
        self.running: EngineConfig | None = None  # what the engine runs with
        self.engine_state = EngineState.STOPPED
        self.effective_dir: str | None = None
        self.host_total: int | None = None
        self.expert_arena = 0  # the running engine's (set_expert_arena)
        self.folder_reports: dict[str, FolderReport] = {}
        self._folder_timer = QTimer(self, singleShot=True, interval=300)
        self._folder_timer.timeout.connect(self._check_folders)
        # Typing settles after a pause (or Enter / leaving the field): only then is a valid value stored.
        self._settling: set[str] = set()
        self._settle_timer = QTimer(self, singleShot=True, interval=SETTLE_MS)
        self._settle_timer.timeout.connect(self._settled)

        actions = RowActions(edited=self._edited, commit=self._commit, reset=self.reset,
                             pick_model=lambda file: self._pick_model(file=file), pick_folder=self._pick_folder)
        content = QWidget()
        content_layout = QVBoxLayout(content)
        for group, title in GROUPS:
            box = QGroupBox(title)
            form = QFormLayout(box)
            form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.AllNonFixedFieldsGrow)
            for name, spec, _default in all_settings():
                if spec.group != group or name in HIDDEN_SETTINGS:
                    continue
                row = build_row(name, spec, actions, locked=store.source(name) is Source.ENV)
                self.rows[name] = row
                label = QLabel(label_of(name))
                label.setToolTip(f"{spec.flag}: {spec.help}")
                form.addRow(label, row.container)
            content_layout.addWidget(box)
        app_box = QGroupBox("Desktop app")
        app_layout = QVBoxLayout(app_box)
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
            self._submit(autostart.is_enabled, self._got_login_state)
        self.file_label = QLabel(f"Saved automatically to {store.path}")
        self.file_label.setWordWrap(True)
        self.file_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.file_label.setStyleSheet("color: #666;")
        app_layout.addWidget(self.file_label)
        content_layout.addWidget(app_box)
        content_layout.addStretch(1)
        self._wheel_guard = guard_wheel(content)
        scroll = self.scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setWidget(content)

        # Bottom: the command line and what applying would do.
        self.command = CommandView()
        self.copy_button = QPushButton("Copy")
        self.copy_button.setToolTip("Copy the command line to the clipboard (a key stays out of it: the line "
                                    "reads it from an environment variable)")
        self.command_note = QLabel()  # how the shown line gets the secrets it does not show
        self.command_note.setWordWrap(True)
        self.copy_button.clicked.connect(self.copy_command)
        self.pending = QLabel()
        self.pending.setWordWrap(True)
        self.apply_button = QPushButton("Apply to running engine")
        self.apply_button.clicked.connect(self.apply)
        self.restart_button = QPushButton("Restart engine")
        self.restart_button.clicked.connect(self.restart_requested)
        self.result = QLabel()
        self.result.setWordWrap(True)
        bottom = QWidget()
        bl = QVBoxLayout(bottom)
        bl.setContentsMargins(0, 0, 0, 0)
        cmd_row = QHBoxLayout()
        cmd_row.addWidget(QLabel("Command line:"))
        cmd_row.addWidget(self.command, 1)
        cmd_row.addWidget(self.copy_button, 0, Qt.AlignmentFlag.AlignTop)
        bl.addLayout(cmd_row)
        bl.addWidget(self.command_note)
        act_row = QHBoxLayout()
        act_row.addWidget(self.pending, 1)
        act_row.addWidget(self.apply_button)
        act_row.addWidget(self.restart_button)
        bl.addLayout(act_row)
        bl.addWidget(self.result)
        layout = QVBoxLayout(self)
        layout.addWidget(scroll, 1)
        layout.addWidget(bottom)

        for name, row in self.rows.items():
            row.set_value(store.value(name))
            self._show_caption(row)
        self._submit(lambda: psutil.virtual_memory().total, self._got_host_total)
        self.refresh()

    # ------------------------------------------------------------------ building rows

    def reload(self) -> None:
        """Show the store's values again (after it was changed elsewhere)."""
        for name, row in self.rows.items():
            if not row.error:
                row.set_value(self.store.value(name))
                self._show_caption(row)
        for name, box in self.pref_boxes.items():
            box.blockSignals(True)
            box.setChecked(getattr(self.store.prefs, name))
            box.blockSignals(False)
        self._folder_timer.start()
        self.refresh()

    # ------------------------------------------------------------------ editing

    def parse_row(self, row: SettingRow) -> Any:
        """The value typed in `row`, parsed; raises SettingError with the reason."""
        text = row.text()
        if is_budget(row.spec):
            return parse_mib(text, row.spec)
        if row.spec.kind in ("int", "float") and text.strip() == "":
            raise SettingError(f"{row.spec.flag}: expected {row.spec.expectation()}, got an empty value")
        return text

    def _edited(self, name: str) -> None:
        """A keystroke: check the text and show the verdict; store nothing until the editing settles."""
        row = self.rows[name]
        try:
            self._validate(row)
            row.error = ""
        except SettingError as e:
            self._refuse(row, e)
        self._show_caption(row)
        self._settling.add(name)
        self._settle_timer.start()
        self.refresh()

    def _refuse(self, row: SettingRow, error: SettingError) -> None:
        """Say in words why the typed value is refused; the engine's wording (with the flag) is the tooltip."""
        row.error = plain_error(row.name, row.spec, row.text(), error, budget=is_budget(row.spec))
        row.flag_error = str(error)

    def _validate(self, row: SettingRow) -> Any:
        """The parsed value of the row's text, checked as the store would check it (raises SettingError)."""
        return setting_of(row.name).parse(self.parse_row(row))

    def _settled(self) -> None:
        names, self._settling = self._settling, set()
        for name in sorted(names):
            self._commit(name)

    def settle_now(self) -> None:
        """Commit what is being typed now (at quit): valid values are kept, others dropped."""
        self._settle_timer.stop()
        self._settled()

    def _commit(self, name: str) -> None:
        """Editing settled (Enter, focus left, a pause, a choice, a picked folder): store and save a valid value.

        A value that does not parse is never stored; the store keeps the last valid one.
        """
        self._settling.discard(name)
        row = self.rows[name]
        try:
            self.store.set(name, self.parse_row(row))
            row.error = ""
        except SettingError as e:
            self._refuse(row, e)
        else:
            self.autosaver.schedule()
        self._show_caption(row)
        if name in FOLDER_SETTINGS or name == "model":
            self._folder_timer.start()
        self.refresh()
        self.committed.emit(name)

    def set_text(self, name: str, text: str) -> None:
        """Type `text` into a setting's editor (as a user would)."""
        row = self.rows[name]
        if isinstance(row.editor, QComboBox):
            row.editor.setCurrentIndex(row.editor.findData(text))
        else:
            assert isinstance(row.editor, QLineEdit)
            row.editor.setText(text)
            self._commit(name)  # a whole value put in at once (a picked folder): nothing to wait for

    def focus_setting(self, name: str) -> None:
        """Scroll to one setting and put the keyboard in its field."""
        row = self.rows[name]
        self.scroll.ensureWidgetVisible(row.container)
        row.editor.setFocus()

    def reset(self, name: str) -> None:
        self.store.reset(name)
        row = self.rows[name]
        row.error = ""
        row.set_value(self.store.value(name))
        self.autosaver.schedule()
        self._show_caption(row)
        self.refresh()

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
                self._got_login_state(not on)
                self.show_result(f"Could not change start at login: {result}", False)

        self._submit(lambda: autostart.set_enabled(on), done)

    def _pick_model(self, file: bool) -> None:
        current = self.rows["model"].text() or os.path.expanduser("~")
        if file:
            path, _ = QFileDialog.getOpenFileName(self, "Choose a GGUF model file", current,
                                                  "GGUF models (*.gguf);;All files (*)")
        else:
            path = QFileDialog.getExistingDirectory(self, "Choose a Hugging Face model folder", current)
        if path:
            self.set_text("model", path)

    def _pick_folder(self, name: str) -> None:
        current = self.rows[name].text() or os.path.expanduser("~")
        path = QFileDialog.getExistingDirectory(self, f"Choose the {label_of(name).lower()}", current)
        if path:
            self.set_text(name, path)

    # ------------------------------------------------------------------ captions and checks

    def _show_caption(self, row: SettingRow) -> None:
        if row.error:
            row.caption.setText(row.error)
            row.caption.setToolTip(row.flag_error)
            row.caption.setStyleSheet("color: #c62828;")
            row.editor.setStyleSheet("QLineEdit { border: 1px solid #c62828; }")
            if row.info is not None:
                row.info.setText("")  # a figure beside a refused value would contradict the error
            return
        row.editor.setStyleSheet("")
        row.caption.setToolTip("")
        parts = ["applies live" if row.spec.live else "applies after a restart",
                 self.store.describe_source(row.name)]
        unused = self._unused_in_mode(row.name)
        if unused:
            parts.insert(0, unused)
        report = self.folder_reports.get("conversation_cache_dir")
        risk = risk_warning(row.name, self._shown_value(row.name), row.text(), self.host_total,
                            report.free_bytes if report else None)
        arena, arena_warns = "", False
        if row.name == "conversation_cache_mib":  # a MoE model's expert arena, and what it leaves
            arena, arena_warns = arena_words(self.expert_arena, self._shown_value(row.name),
                                             self._shown_value("conversation_cache_min_free_mib"), self.host_total,
                                             self.store.value("conversation_cache_storage"))
            if arena and not arena_warns:
                parts.append(arena)
        warning = "; ".join(w for w in (self._folder_warning(row.name), risk, arena if arena_warns else "") if w)
        if warning:
            parts.append(warning)
        row.caption.setText(" · ".join(parts))
        row.caption.setStyleSheet("color: #b26a00;" if warning else "color: #666;")
        if row.info is not None:
            row.info.setText(self._info_text(row.name))

    def _unused_in_mode(self, name: str) -> str:
        """Why a budget does nothing in the chosen storage mode ("" when it is used)."""
        mode = self.store.value("conversation_cache_storage")
        if name == "conversation_cache_mib" and mode == "disk":
            return "not used in disk mode"
        if name == "conversation_cache_disk_mib" and mode == "ram":
            return "not used in ram mode"
        return ""

    def _grey_unused(self) -> None:
        """Grey out the budgets the storage mode does not use (their values are kept for another mode)."""
        for name in ("conversation_cache_mib", "conversation_cache_disk_mib"):
            row = self.rows[name]
            enabled = not self._unused_in_mode(name) and self.store.source(name) is not Source.ENV
            if row.editor.isEnabled() != enabled:
                row.editor.setEnabled(enabled)
                if not row.error:
                    self._show_caption(row)

    def _shown_value(self, name: str) -> Any:
        """The value the field's text says (typed, maybe not stored yet), else the stored one."""
        try:
            return self._validate(self.rows[name])
        except SettingError:
            return self.store.value(name)

    def _info_text(self, name: str) -> str:
        if name in ("conversation_cache_mib", "conversation_cache_min_free_mib"):
            value = format_mib(self._shown_value(name))
            total = f" · host RAM {format_bytes(self.host_total)}" if self.host_total else ""
            return f"= {value}{total}"
        if name == "conversation_cache_disk_mib":
            report = self.folder_reports.get("conversation_cache_dir")
            free = f" · free on disk {format_bytes(report.free_bytes)}" if report and report.free_bytes else ""
            return f"= {format_mib(self._shown_value(name))}{free}"
        if name == "conversation_cache_dir" and self.effective_dir:
            return ""
        return ""

    def _folder_warning(self, name: str) -> str:
        report = self.folder_reports.get(name)
        if report is None:
            return ""
        if name == "model":
            return "" if report.writable or os.path.exists(report.path) else "not found"
        if not report.writable:
            return f"not writable: {report.existing}"
        return ""

    def _check_folders(self) -> None:
        targets = {
            "conversation_cache_dir": self.store.value("conversation_cache_dir") or default_cache_dir(),
        }
        if self.store.value("slot_save_path"):
            targets["slot_save_path"] = self.store.value("slot_save_path")
        else:
            self.folder_reports.pop("slot_save_path", None)
        model = self.store.value("model")

        def work() -> dict[str, Any]:
            out: dict[str, Any] = {name: check_folder(path) for name, path in targets.items()}
            if model:
                path = os.path.expanduser(model)
                out["model"] = FolderReport(path, path, os.path.exists(path), None)
            return out

        self._submit(work, self._got_folder_reports)

    def _got_folder_reports(self, result: Any) -> None:
        if isinstance(result, BaseException):
            return
        self.folder_reports.pop("model", None)
        self.folder_reports.update(result)
        for name in ("conversation_cache_dir", "slot_save_path", "model", "conversation_cache_disk_mib"):
            if not self.rows[name].error:
                self._show_caption(self.rows[name])

    def _got_host_total(self, result: Any) -> None:
        if isinstance(result, int):
            self.host_total = result
            for name in ("conversation_cache_mib", "conversation_cache_min_free_mib"):
                self._show_caption(self.rows[name])
        self._check_folders()

    # ------------------------------------------------------------------ engine side

    def set_engine(self, state: EngineState, running: EngineConfig | None) -> None:
        """The engine's state and the config it runs with (None when not running)."""
        self.engine_state = state
        self.running = running
        self.refresh()

    def set_expert_arena(self, arena_bytes: int) -> None:
        """The running engine's expert arena (engine.expert_arena_bytes; 0 for a dense model), said beside the
        RAM budget."""
        if arena_bytes != self.expert_arena:
            self.expert_arena = arena_bytes
            self._show_caption(self.rows["conversation_cache_mib"])

    def set_effective_dir(self, path: str | None) -> None:
        self.effective_dir = path
        row = self.rows["conversation_cache_dir"]
        if row.info is not None:
            row.info.setText("")
        row.editor.setToolTip(f"{row.spec.flag}: {row.spec.help}" + (f"\nThe engine uses {path}" if path else ""))

    def differences(self) -> tuple[dict[str, Any], list[str]]:
        """(live changes {name: value}, names that need a restart) between the settings and the running engine."""
        if self.running is None:
            return {}, []
        wanted = self.store.engine_config()
        live: dict[str, Any] = {}
        restart: list[str] = []
        for f in fields(EngineConfig):
            new, old = getattr(wanted, f.name), getattr(self.running, f.name)
            if new == old:
                continue
            if f.metadata["setting"].live:
                live[f.name] = new
            else:
                restart.append(f.name)
        return live, restart

    def refresh(self) -> None:
        """Update the command line, the greyed budgets and what Apply / Restart would do."""
        self._grey_unused()
        try:
            config = self.store.engine_config()
            self.command.setText(command_line(config))
            names = secret_variables(config)
            self.command_note.setText("Before pasting it into a shell, set " + " and ".join(
                f"{n} to the key (export {n}=…)" for n in names) + "." if names else "")
            self.command_note.setVisible(bool(names))
        except SettingError as e:  # the store refuses such values; shown rather than hidden if it happens
            self.command.setText(str(e))
        errors = [r for r in self.rows.values() if r.error]
        live, restart = self.differences()
        ready = self.engine_state is EngineState.READY
        self.apply_button.setEnabled(ready and bool(live) and not errors)
        self.restart_button.setVisible(bool(restart) and self.running is not None)
        if errors:
            text = f"{len(errors)} value(s) not accepted: fix them to save and apply."
        elif self.running is None:
            text = "The engine is not running; it starts with these settings."
        elif not live and not restart:
            text = "The running engine uses these settings."
        else:
            bits = []
            if live:
                bits.append("can apply live: " + ", ".join(label_of(n) for n in live))
            if restart:
                bits.append("need a restart: " + ", ".join(label_of(n) for n in restart))
            text = "Changed — " + "; ".join(bits) + "."
        self.pending.setText(text)

    def apply(self) -> None:
        live, _ = self.differences()
        if live:
            self.result.setText("Applying…")
            self.apply_requested.emit(live)

    def show_result(self, text: str, ok: bool) -> None:
        self.result.setText(text)
        self.result.setStyleSheet("" if ok else "color: #c62828;")
        self.refresh()

    def copy_command(self) -> None:
        QGuiApplication.clipboard().setText(command_line(self.store.engine_config()))
