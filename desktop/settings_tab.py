"""The Settings tab: every engine setting from `engine.config`'s table, validated as you type, saved automatically.

Each row shows where its value comes from (default, settings file, environment) and whether it applies to a
running engine live or after a restart. A live setting is applied to the running engine by itself once its edit
settles and the value is valid (`apply_requested`, sent with `PUT /cache/config`; a folder only on Enter,
leaving the field or a pick, never on a pause in typing); Apply sends again what was declined or refused, Revert
goes back to what the engine runs. A restart is offered for the rest, never forced.

Beside it: the rows (settings_rows.py), what each says beneath its field (settings_captions.py), the words
(settings_words.py), the "Desktop app" group (settings_app_box.py) and the command line with the buttons below the
page (settings_footer.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any

import psutil
from PySide6.QtCore import QTimer, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QFormLayout,
    QGroupBox,
    QLabel,
    QLineEdit,
    QScrollArea,
    QVBoxLayout,
    QWidget,
)

from desktop.autostart import Autostart
from desktop.engine_process import EngineState
from desktop.gpu import GPU_ONLY_SETTINGS, nvidia_gpu_present
from desktop.settings import HIDDEN_SETTINGS, AutoSaver, SettingsStore, Source, is_budget
from desktop.settings_app_box import DesktopAppBox
from desktop.settings_captions import RowCaptions
from desktop.settings_footer import SettingsFooter
from desktop.settings_rows import FOLDER_SETTINGS, RowActions, SettingRow, build_row, choose_path, tooltip
from desktop.settings_words import GROUPS, group_note, label_of, plain_error
from desktop.store_check import check_store
from desktop.widgets import guard_wheel
from engine.config import EngineConfig, all_settings
from engine.setting import SettingError

SETTLE_MS = 1200  # a pause in typing this long counts as done


class SettingsTab(QWidget):
    apply_requested = Signal(dict)  # {field name: value} of live settings to send with PUT /cache/config
    restart_requested = Signal()
    prefs_changed = Signal()
    committed = Signal(str)  # a setting's editing settled (its value stored when valid)

    def __init__(self, store: SettingsStore, autosaver: AutoSaver,
                 submit: Callable[[Callable[[], Any], Callable[[Any], None]], None],
                 autostart: Autostart | None = None, parent: QWidget | None = None, *,
                 gpu: bool | None = None) -> None:
        """`gpu`: whether this machine has an NVIDIA GPU (None: look); without one the GPU-only settings are
        hidden, except those changed from their defaults (in effect, so shown)."""
        super().__init__(parent)
        self.store = store
        self.gpu = nvidia_gpu_present() if gpu is None else gpu
        self.autosaver = autosaver
        self._submit = submit
        self.rows: dict[str, SettingRow] = {}
        self.running: EngineConfig | None = None  # what the engine runs with
        self.engine_state = EngineState.STOPPED
        self.effective_dir: str | None = None
        self.captions = RowCaptions(store, self.rows, submit, self)  # what each row says beneath its field
        # Typing settles after a pause (or Enter / leaving the field): only then is a valid value stored.
        self._settling: set[str] = set()
        self._settle_timer = QTimer(self, singleShot=True, interval=SETTLE_MS)
        self._settle_timer.timeout.connect(self._settled)
        # One live apply at a time: `_applying` until show_result, `_apply_again` when an edit settled meanwhile.
        self._applying = False
        self._apply_again = False

        actions = RowActions(edited=self._edited, commit=self._commit, reset=self.reset,
                             pick_model=lambda file: self._pick("model", file=file), pick_folder=self._pick,
                             test_store=self._test_store)
        content = QWidget()
        content_layout = QVBoxLayout(content)
        hidden = [] if self.gpu else [name for name in GPU_ONLY_SETTINGS if store.source(name) is Source.DEFAULT]
        self.gpu_note = QLabel("No NVIDIA GPU found on this computer: the settings that only act on one are hidden ("
                               + ", ".join(label_of(n) for n in hidden) + ").")
        self.gpu_note.setWordWrap(True)
        self.gpu_note.setStyleSheet("color: #666;")
        self.gpu_note.setVisible(bool(hidden))
        content_layout.addWidget(self.gpu_note)
        specs = {name: spec for name, spec, _ in all_settings()}
        for group, title in GROUPS:
            names = [name for name, spec, _ in all_settings()
                     if spec.group == group and name not in HIDDEN_SETTINGS and name not in hidden]
            box = QGroupBox(title)
            form = QFormLayout(box)
            form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.AllNonFixedFieldsGrow)
            note = QLabel(group_note(names, specs))  # how they apply, said once here and in each tooltip
            note.setWordWrap(True)
            note.setStyleSheet("color: #666;")
            form.addRow(note)
            for name in names:
                spec = specs[name]
                row = build_row(name, spec, actions, locked=store.source(name) is Source.ENV)
                self.rows[name] = row
                label = QLabel(label_of(name))
                label.setToolTip(tooltip(spec))
                form.addRow(label, row.container)
            content_layout.addWidget(box)
        self.app_box = DesktopAppBox(store, autosaver, submit, autostart)
        self.app_box.prefs_changed.connect(self.prefs_changed)
        self.app_box.failed.connect(self._show_failure)
        self.login_box = self.app_box.login_box
        content_layout.addWidget(self.app_box)
        content_layout.addStretch(1)
        self._wheel_guard = guard_wheel(content)
        scroll = self.scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setWidget(content)

        # Bottom: the command line and what applying would do.
        footer = self.footer = SettingsFooter(store)
        self.command, self.copy_button, self.command_note = footer.command, footer.copy_button, footer.command_note
        self.pending, self.result = footer.pending, footer.result
        self.apply_button, self.revert_button = footer.apply_button, footer.revert_button
        self.restart_button = footer.restart_button
        self.apply_button.clicked.connect(self.apply)
        self.revert_button.clicked.connect(self.revert)
        self.restart_button.clicked.connect(self.restart_requested)
        layout = QVBoxLayout(self)
        layout.addWidget(scroll, 1)
        layout.addWidget(footer)

        for name, row in self.rows.items():
            row.set_value(store.value(name))
            self.captions.show(row)
        self._submit(lambda: psutil.virtual_memory().total, self.captions.got_host_total)
        self.refresh()

    # ------------------------------------------------------------------ building rows

    def reload(self) -> None:
        """Show the store's values again (after it was changed elsewhere)."""
        for name, row in self.rows.items():
            if not row.error:
                row.set_value(self.store.value(name))
                self.captions.show(row)
        self.app_box.reload()
        self.captions.check_folders_soon()
        self.refresh()

    # ------------------------------------------------------------------ editing

    def _edited(self, name: str) -> None:
        """A keystroke: check the text and show the verdict; store nothing until the editing settles."""
        row = self.rows[name]
        try:
            row.validated()
            row.error = ""
        except SettingError as e:
            self._refuse(row, e)
        self.captions.show(row)
        self._settling.add(name)
        self._settle_timer.start()
        self.refresh()

    def _refuse(self, row: SettingRow, error: SettingError) -> None:
        """Say in words why the typed value is refused; the engine's wording (with the flag) is the tooltip."""
        row.error = plain_error(row.name, row.spec, row.text(), error, budget=is_budget(row.spec))
        row.flag_error = str(error)

    def _settled(self, apply: bool = True) -> None:
        names, self._settling = self._settling, set()
        for name in sorted(names):
            self._commit(name, paused=True, apply=apply)

    def settle_now(self) -> None:
        """Commit what is being typed now (at quit): valid values are kept, others dropped; nothing is sent to
        an engine that is about to stop (it starts with them next time)."""
        self._settle_timer.stop()
        self._settled(apply=False)

    def _commit(self, name: str, paused: bool = False, apply: bool = True) -> None:
        """Editing settled (Enter, focus left, a pause, a choice, a picked folder): store and save a valid value,
        and apply it to the running engine when it is live (a folder not on a pause: a half-typed path would
        move the cache to it).

        A value that does not parse is never stored; the store keeps the last valid one.
        """
        self._settling.discard(name)
        row = self.rows[name]
        try:
            self.store.set(name, row.parsed())
            row.error = ""
        except SettingError as e:
            self._refuse(row, e)
        else:
            self.autosaver.schedule()
        self.captions.show(row)
        if name in FOLDER_SETTINGS or name == "model":
            self.captions.check_folders_soon()
        if not paused:
            self._forget_result()
        self.refresh()
        # A pause stores the value but never applies it: "2" on the way to "2048" would shrink a budget (and its
        # question would take the keyboard mid-word); Enter, leaving the field or a choice applies.
        if apply and not row.error and row.spec.live and not paused:
            self.apply_live_changes()
        self.committed.emit(name)

    def set_text(self, name: str, text: str) -> None:
        """Type `text` into a setting's editor (as a user would)."""
        row = self.rows[name]
        if isinstance(row.editor, QComboBox):
            row.editor.setCurrentIndex(row.editor.findData(text))
        elif isinstance(row.editor, QCheckBox):
            row.editor.setChecked(row.spec.parse(text))  # a change commits (toggled)
        else:
            assert isinstance(row.editor, QLineEdit)
            row.editor.setText(text)
            self._commit(name)  # a whole value put in at once (a picked folder): nothing to wait for

    def focus_setting(self, name: str) -> None:
        """Scroll to one setting and put the keyboard in its field (one not shown here: nothing to focus)."""
        row = self.rows.get(name)
        if row is None:
            return
        self.scroll.ensureWidgetVisible(row.container)
        row.editor.setFocus()

    def reset(self, name: str) -> None:
        """Back to the default, stored, saved and (a live setting) applied, as an edit that settled."""
        self._settling.discard(name)  # a pending pause-commit of the old text must not undo the reset
        self.store.reset(name)
        row = self.rows[name]
        row.error = ""
        row.set_value(self.store.value(name))
        self.autosaver.schedule()
        self.captions.show(row)
        self._forget_result()
        self.refresh()
        if row.spec.live:
            self.apply_live_changes()
        self.committed.emit(name)

    def _forget_result(self) -> None:
        """The last apply's outcome no longer describes what is shown once the values or the engine change:
        "Applied to the running engine: Expiry = 20.0" under a reset Expiry would be read as the current state."""
        if not self._applying:
            self.result.setText("")
            self.result.setStyleSheet("")

    def _show_failure(self, text: str) -> None:
        """A change that did not go through (start at login), said where an apply's outcome is."""
        self.result.setText(text)
        self.result.setStyleSheet("color: #c62828;")

    def _pick(self, name: str, file: bool = False) -> None:
        """A file or folder chosen in the platform's dialog goes into the setting as if typed whole."""
        path = choose_path(self, name, self.rows[name].text(), file=file)
        if path:
            self.set_text(name, path)

    def _test_store(self, name: str) -> None:
        """Ask the store the URL names whether it answers, off the UI thread; the row says what it found."""
        row = self.rows[name]
        assert row.check is not None
        url = row.text().strip()
        if not url:
            row.check.setText("Give the store's URL first (redis://host:6379/0).")
            return
        row.check.setText("Testing…")
        row.check.setStyleSheet("color: #555;")

        def done(result: Any) -> None:
            ok, text = (False, f"Test failed: {result}") if isinstance(result, BaseException) else result
            assert row.check is not None
            row.check.setText(text)
            row.check.setStyleSheet("color: #2e7d32;" if ok else "color: #c62828;")

        self._submit(lambda: check_store(url), done)

    # ------------------------------------------------------------------ engine side

    def set_engine(self, state: EngineState, running: EngineConfig | None) -> None:
        """The engine's state and the config it runs with (None when not running); once it is Ready, what was
        edited while it started is applied."""
        became_ready = state is EngineState.READY and self.engine_state is not EngineState.READY
        if state is not self.engine_state:
            self._applying = self._applying and state is EngineState.READY
            self._forget_result()  # an outcome told of the engine before a restart is not this one's
        self.engine_state = state
        self.running = running
        if state is not EngineState.READY:
            self._applying = self._apply_again = False  # no answer will come from an engine that is gone
        self.refresh()
        if became_ready:
            self.apply_live_changes()

    @property
    def host_total(self) -> int | None:
        """The host's RAM in bytes, once read (the budgets' figures and warnings use it)."""
        return self.captions.host_total

    def set_expert_arena(self, arena_bytes: int) -> None:
        """The running engine's expert arena (engine.expert_arena_bytes; 0 for a dense model), said beside the
        RAM budget."""
        if arena_bytes != self.captions.expert_arena:
            self.captions.expert_arena = arena_bytes
            self.captions.show(self.rows["conversation_cache_mib"])

    def set_effective_dir(self, path: str | None) -> None:
        self.effective_dir = path
        row = self.rows["conversation_cache_dir"]
        if row.info is not None:
            row.info.setText("")
        row.editor.setToolTip(tooltip(row.spec, f"The engine uses {path}" if path else ""))

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
        self.captions.grey_unused()
        self.footer.show_command()
        errors = [r for r in self.rows.values() if r.error]
        live, restart = self.differences()
        ready = self.engine_state is EngineState.READY
        self.apply_button.setVisible(bool(live))
        self.apply_button.setEnabled(ready and bool(live) and not errors and not self._applying)
        self.revert_button.setVisible(bool(live or restart))
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
                verb = "applying live" if self._applying else "not applied yet"
                bits.append(f"{verb}: " + ", ".join(label_of(n) for n in live))
            if restart:
                bits.append("need a restart: " + ", ".join(label_of(n) for n in restart))
            text = "Changed — " + "; ".join(bits) + "."
        self.pending.setText(text)

    def apply_live_changes(self) -> None:
        """Send the live settings that differ from the running engine's, unless an apply is still in flight
        (then once it answers) or a value is refused or the engine is not Ready."""
        if self._applying:
            self._apply_again = True
            return
        if self.engine_state is EngineState.READY and not any(r.error for r in self.rows.values()):
            self.apply()

    def apply(self) -> None:
        live, _ = self.differences()
        if live and not self._applying:
            self._applying = True
            self.result.setText("Applying to the running engine…")
            self.result.setStyleSheet("")
            self.refresh()
            self.apply_requested.emit(live)

    def revert(self) -> None:
        """Every setting back to what the running engine uses (the file follows)."""
        if self.running is None:
            return
        live, restart = self.differences()
        kept = self.put_back([*live, *restart])
        self.result.setText("Reverted to what the running engine uses." + (
            f" Set by the environment, not reverted: {', '.join(kept)}." if kept else ""))
        self.refresh()

    def put_back(self, names: list[str]) -> list[str]:
        """These settings back to what the running engine uses (Revert; an apply the user declined: Cancel means
        the old value, in the field, in the file and at the next start). Returns the labels of those the
        environment sets, which stay."""
        kept: list[str] = []
        if self.running is None:
            return kept
        for name in names:
            try:
                self.store.set(name, getattr(self.running, name))
            except SettingError:  # set by the environment since: its caption says so
                kept.append(label_of(name))
                continue
            row = self.rows.get(name)
            if row is not None:
                row.error = ""
                row.set_value(self.store.value(name))
                self.captions.show(row)
        self.autosaver.schedule()
        self.refresh()
        return kept

    def show_result(self, text: str, ok: bool) -> None:
        """The outcome of an apply (the engine's answer, a refusal, a declined eviction)."""
        again, self._applying, self._apply_again = self._apply_again, False, False
        self.result.setText(text)
        self.result.setStyleSheet("" if ok else "color: #c62828;")
        self.refresh()
        if again:
            self.apply_live_changes()  # an edit settled while the engine answered
