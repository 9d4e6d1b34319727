"""What the Settings tab says under and beside each field: the refusal in words, or only what is worth saying
(a value changed from its default and when it applies, one set by the environment, what 0 means where it means
something, warnings: a folder not writable, a risky budget), the figures beside a budget, and the budgets the
storage mode does not use greyed out. An untouched field says nothing: how a group applies is said once above it
and in each field's tooltip. Folder checks and the host's RAM are read off the GUI thread.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from PySide6.QtCore import QObject, QTimer

from desktop.folders import FolderReport, check_folder
from desktop.settings import SettingsStore, Source, format_bytes, format_mib
from desktop.settings_rows import SettingRow
from desktop.settings_words import applies_words, arena_words, risk_warning, value_words, zero_words
from engine.config import EngineConfig, default_cache_dir
from engine.setting import SettingError

Submit = Callable[[Callable[[], Any], Callable[[Any], None]], None]


class RowCaptions(QObject):
    """The captions and figures of the Settings tab's rows (`rows`: by setting name)."""

    def __init__(self, store: SettingsStore, rows: dict[str, SettingRow], submit: Submit,
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.store, self.rows, self._submit = store, rows, submit
        self.host_total: int | None = None
        self.expert_arena = 0  # the running engine's (SettingsTab.set_expert_arena)
        self.folder_reports: dict[str, FolderReport] = {}
        self._folder_timer = QTimer(self, singleShot=True, interval=300)
        self._folder_timer.timeout.connect(self.check_folders)

    def check_folders_soon(self) -> None:
        """Check the folders again shortly (a path was edited: one check for a burst of edits)."""
        self._folder_timer.start()

    def show(self, row: SettingRow) -> None:
        """The caption under `row`: its refusal, or what is worth saying of its value ("" hides it)."""
        if row.error:
            self._say(row, row.error)
            row.caption.setToolTip(row.flag_error)
            row.caption.setStyleSheet("color: #c62828;")
            row.editor.setStyleSheet("QLineEdit { border: 1px solid #c62828; }")
            if row.info is not None:
                row.info.setText("")  # a figure beside a refused value would contradict the error
            return
        row.editor.setStyleSheet("")
        row.caption.setToolTip("")
        value = self._shown_value(row.name)
        parts = [zero_words(row.name, value)]
        unused = self.unused_in_mode(row.name)
        if unused:
            parts.insert(0, unused)
        if self.store.source(row.name) is Source.ENV:
            parts.append(self.store.describe_source(row.name))
        else:
            default = getattr(EngineConfig(), row.name)
            if value != default:
                parts += [f"changed from the default ({value_words(row.spec, default)})", applies_words(row.spec)]
        report = self.folder_reports.get("conversation_cache_dir")
        # A budget the storage mode does not use risks nothing: warning that 16 GiB exceeds a small disk's free
        # space while storage is "ram" would only alarm.
        risk = "" if unused else risk_warning(row.name, value, row.text(), self.host_total,
                                              report.free_bytes if report else None)
        arena, arena_warns = "", False
        if row.name == "conversation_cache_mib":  # a MoE model's expert arena, and what it leaves
            arena, arena_warns = arena_words(self.expert_arena, value,
                                             self._shown_value("conversation_cache_min_free_mib"), self.host_total,
                                             self.store.value("conversation_cache_storage"))
            if arena and not arena_warns:
                parts.append(arena)
        warning = "; ".join(w for w in (self._folder_warning(row.name), risk, arena if arena_warns else "") if w)
        if warning:
            parts.append(warning)
        self._say(row, " · ".join(p for p in parts if p))
        row.caption.setStyleSheet("color: #b26a00;" if warning else "color: #666;")
        if row.info is not None:
            row.info.setText(self._info_text(row.name))

    @staticmethod
    def _say(row: SettingRow, text: str) -> None:
        """Put `text` under the field; an empty caption is hidden (it would only leave a gap)."""
        row.caption.setText(text)
        row.caption.setVisible(bool(text))

    def unused_in_mode(self, name: str) -> str:
        """Why a budget does nothing in the chosen storage mode ("" when it is used)."""
        mode = self.store.value("conversation_cache_storage")
        if name == "conversation_cache_mib" and mode == "disk":
            return "not used in disk mode"
        if name == "conversation_cache_disk_mib" and mode == "ram":
            return "not used in ram mode"
        return ""

    def grey_unused(self) -> None:
        """Grey out the budgets the storage mode does not use (their values are kept for another mode)."""
        for name in ("conversation_cache_mib", "conversation_cache_disk_mib"):
            row = self.rows[name]
            enabled = not self.unused_in_mode(name) and self.store.source(name) is not Source.ENV
            if row.editor.isEnabled() != enabled:
                row.editor.setEnabled(enabled)
                if not row.error:
                    self.show(row)

    def _shown_value(self, name: str) -> Any:
        """The value the field's text says (typed, maybe not stored yet), else the stored one."""
        try:
            return self.rows[name].validated()
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

    def check_folders(self) -> None:
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
                self.show(self.rows[name])

    def got_host_total(self, result: Any) -> None:
        if isinstance(result, int):
            self.host_total = result
            for name in ("conversation_cache_mib", "conversation_cache_min_free_mib"):
                self.show(self.rows[name])
        self.check_folders()
