"""One row of the Settings tab: the editor for a setting, its unit and figures, Reset, and the caption below."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from desktop.settings import is_budget, parse_mib
from desktop.settings_words import CHOICE_WORDS, applies_words, label_of
from engine.config import all_settings, default_cache_dir, setting_of
from engine.setting import Setting, SettingError

FOLDER_SETTINGS = tuple(name for name, spec, _ in all_settings() if spec.ui == "folder")


@dataclass(frozen=True, slots=True)
class RowActions:
    """What a row's widgets call: by setting name (pick_model takes True for a file, False for a folder)."""

    edited: Callable[[str], None]  # a keystroke
    commit: Callable[[str], None]  # editing settled
    reset: Callable[[str], None]
    pick_model: Callable[[bool], None]
    pick_folder: Callable[[str], None]
    test_store: Callable[[str], None]  # a store URL's "Test connection"


class SettingRow:
    """The editor, caption and extras for one setting."""

    def __init__(self, name: str, spec: Setting, editor: QWidget, container: QWidget, caption: QLabel,
                 info: QLabel | None = None, check: QLabel | None = None) -> None:
        self.name, self.spec, self.editor, self.container, self.caption, self.info = (
            name, spec, editor, container, caption, info)
        self.check = check  # a store URL: what its "Test connection" found
        self.error = ""  # why the typed value is refused, in words ("" when accepted)
        self.flag_error = ""  # the same in the engine's words, naming the flag

    def text(self) -> str:
        if isinstance(self.editor, QComboBox):
            return str(self.editor.currentData())
        if isinstance(self.editor, QCheckBox):
            return "true" if self.editor.isChecked() else "false"
        assert isinstance(self.editor, QLineEdit)
        return self.editor.text()

    def parsed(self) -> Any:
        """The typed text as a value (a budget in MiB from "4 GiB"); raises SettingError with the reason."""
        if isinstance(self.editor, QCheckBox):
            return self.editor.isChecked()
        text = self.text()
        if is_budget(self.spec):
            return parse_mib(text, self.spec)
        if self.spec.kind in ("int", "float") and text.strip() == "":
            raise SettingError(f"{self.spec.flag}: expected {self.spec.expectation()}, got an empty value")
        return text

    def validated(self) -> Any:
        """The parsed value, checked as the store would check it (raises SettingError)."""
        return setting_of(self.name).parse(self.parsed())

    def set_value(self, value: Any) -> None:
        self.editor.blockSignals(True)
        if isinstance(self.editor, QComboBox):
            self.editor.setCurrentIndex(max(0, self.editor.findData(value)))
        elif isinstance(self.editor, QCheckBox):
            self.editor.setChecked(value is True)
        else:
            assert isinstance(self.editor, QLineEdit)
            if value is None:
                text = ""
            elif is_budget(self.spec):
                text = str(value)
            elif isinstance(value, float) and value.is_integer():
                text = str(int(value))
            else:
                text = str(value)
            self.editor.setText(text)
        self.editor.blockSignals(False)


def tooltip(spec: Setting, extra: str = "") -> str:
    """A field's tooltip: the flag and its help, when a change reaches the engine, and `extra`."""
    applies = applies_words(spec)
    return f"{spec.flag}: {spec.help}\n{applies[:1].upper()}{applies[1:]}." + (f"\n{extra}" if extra else "")


def build_row(name: str, spec: Setting, actions: RowActions, locked: bool) -> SettingRow:
    """The editor, its unit and figures, Reset and the caption for one setting; `locked`: set by the environment."""
    container = QWidget()
    outer = QVBoxLayout(container)
    outer.setContentsMargins(0, 0, 0, 0)
    outer.setSpacing(1)
    line = QHBoxLayout()
    info: QLabel | None = None
    if spec.ui == "choice":
        editor: QWidget = QComboBox()
        assert isinstance(editor, QComboBox)
        for choice in spec.choices:
            editor.addItem(CHOICE_WORDS.get(name, {}).get(choice, choice), choice)
        editor.currentIndexChanged.connect(lambda _i, n=name: actions.commit(n))  # a choice is always whole
        line.addWidget(editor, 1)
    elif spec.kind == "bool":
        # Yes or no: a checkbox (its label is the row's); a click is a whole value, stored and applied at once.
        editor = QCheckBox()
        assert isinstance(editor, QCheckBox)
        editor.toggled.connect(lambda _on, n=name: actions.commit(n))
        line.addWidget(editor)
        line.addStretch(1)
    else:
        editor = QLineEdit()
        assert isinstance(editor, QLineEdit)
        editor.textChanged.connect(lambda _t, n=name: actions.edited(n))
        editor.editingFinished.connect(lambda n=name: actions.commit(n))
        if spec.ui == "secret":
            editor.setEchoMode(QLineEdit.EchoMode.Password)
            editor.setPlaceholderText("none: every request is accepted")
        line.addWidget(editor, 1)
        if spec.ui == "model":
            editor.setPlaceholderText("bundled SmolLM2-135M-Instruct (Q4_1 GGUF)")
            file_button = QToolButton(text="File…")
            file_button.clicked.connect(lambda: actions.pick_model(True))
            folder_button = QToolButton(text="Folder…")
            folder_button.clicked.connect(lambda: actions.pick_model(False))
            line.addWidget(file_button)
            line.addWidget(folder_button)
        elif spec.ui == "folder":
            if name == "conversation_cache_dir":
                editor.setPlaceholderText(default_cache_dir())
            else:
                editor.setPlaceholderText("unset: slot files disabled")
            browse = QToolButton(text="Browse…")
            browse.clicked.connect(lambda _=False, n=name: actions.pick_folder(n))
            line.addWidget(browse)
        elif spec.url:
            editor.setPlaceholderText("none: parked conversations stay on this machine")
            test = QToolButton(text="Test connection")
            test.setObjectName(f"{name}_test")
            test.clicked.connect(lambda _=False, n=name: actions.test_store(n))
            line.addWidget(test)
        elif spec.ui == "secret":
            show = QToolButton(text="Show")
            show.setCheckable(True)
            show.toggled.connect(lambda on, e=editor: e.setEchoMode(
                QLineEdit.EchoMode.Normal if on else QLineEdit.EchoMode.Password))
            line.addWidget(show)
        if spec.unit and spec.kind in ("int", "float"):
            unit = QLabel("MiB (or GiB)" if is_budget(spec) else spec.unit)
            line.addWidget(unit)
        if is_budget(spec) or name == "conversation_cache_dir":
            info = QLabel()
            info.setStyleSheet("color: #555; margin-left: 6px;")
            line.addWidget(info)
    editor.setToolTip(tooltip(spec))
    editor.setObjectName(name)
    if spec.kind in ("int", "float") or name in ("host", "dtype", "log_level", "devices", "layer_split"):
        # Short values: a narrow field, the unit and figures beside it, the rest of the line free.
        line.setStretch(0, 0)
        editor.setFixedWidth(180)
        line.addStretch(1)
    reset = QToolButton(text="Reset")
    reset.setToolTip("Back to the default")
    reset.clicked.connect(lambda _=False, n=name: actions.reset(n))
    line.addWidget(reset)
    caption = QLabel()
    caption.setWordWrap(True)
    caption.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
    outer.addLayout(line)
    outer.addWidget(caption)
    check = None
    if spec.url:
        check = QLabel()
        check.setWordWrap(True)
        check.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        outer.addWidget(check)
    row = SettingRow(name, spec, editor, container, caption, info, check)
    if locked:
        editor.setEnabled(False)
        reset.setEnabled(False)
    return row


def choose_path(parent: QWidget, name: str, current: str, *, file: bool = False) -> str:
    """The platform's dialog for setting `name`: a GGUF file or a Hugging Face folder for the model, else a folder;
    "" when cancelled. It opens at `current` (the home folder when empty)."""
    start = current or os.path.expanduser("~")
    if name == "model" and file:
        path, _ = QFileDialog.getOpenFileName(parent, "Choose a GGUF model file", start,
                                              "GGUF models (*.gguf);;All files (*)")
        return path
    title = "Choose a Hugging Face model folder" if name == "model" else f"Choose the {label_of(name).lower()}"
    return QFileDialog.getExistingDirectory(parent, title, start)
