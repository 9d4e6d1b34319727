"""How one setting is declared: its flag, label, kind, bounds and help, and how a raw value (a flag's text, JSON, a
settings file's entry) is parsed and checked against them. `engine.config` declares the engine's settings with it.
Imports nothing heavy, like engine.config, so the desktop app reads it without torch."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

# How a form shows a setting: a line of text, a list of choices, a size in MiB (GiB accepted), a hidden key,
# a folder (with Browse), or the model (a file or a folder).
UI_KINDS = ("line", "choice", "size", "secret", "folder", "model")

class SettingError(ValueError):
    """A setting was given a value it cannot take; the message names the setting, the expectation and the value."""


@dataclass(frozen=True, slots=True)
class Setting:
    """How one setting is named, parsed, bounded and explained everywhere it appears."""

    flag: str
    help: str
    kind: str  # "int", "float", "str", "path", "choice", "bool", "optional_str", "optional_path"
    group: str  # "model", "runtime", "server", "cache"
    label: str  # the words a form shows it with (the desktop's Settings tab)
    ui: str = ""  # one of UI_KINDS; empty = what the kind implies (see __post_init__)
    unit: str = ""
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] = ()
    live: bool = False  # can change on a running engine through PUT /cache/config
    secret: bool = False  # never echoed back (API key)
    url: bool = False  # a store URL that may carry a password: shown with the password replaced by ***
    metavar: str = ""

    def __post_init__(self) -> None:
        assert self.label, f"{self.flag}: every setting declares its label"
        if not self.ui:
            implied = ("choice" if self.kind == "choice" else "secret" if self.secret
                       else "size" if self.kind == "int" and self.unit == "MiB" else "line")
            object.__setattr__(self, "ui", implied)  # frozen: set once, here
        assert self.ui in UI_KINDS, f"{self.flag}: ui {self.ui!r} is not one of {UI_KINDS}"

    def expectation(self) -> str:
        """Human wording of what a valid value looks like, used in every error message."""
        if self.kind == "int":
            unit = f" of {self.unit}" if self.unit else ""
            bounds = _bounds_text(self.minimum, self.maximum)
            return f"a whole number{unit}{bounds}"
        if self.kind == "float":
            return f"a number{_bounds_text(self.minimum, self.maximum)}"
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        if self.kind == "bool":
            return "true or false"
        if self.kind in ("path", "optional_path"):
            return "a path"
        return "text"

    def parse(self, raw: Any) -> Any:
        """Turn a flag string, JSON value or settings-file value into this setting's type, or raise SettingError."""
        if raw is None and self.kind in ("optional_str", "optional_path"):
            return None
        if self.kind == "int":
            value = _parse_int(raw)
            if value is None:
                raise self.error(raw)
            return self._check_bounds(value, raw)
        if self.kind == "float":
            number = _parse_float(raw)
            if number is None:
                raise self.error(raw)
            return self._check_bounds(number, raw)
        if self.kind == "bool":
            if isinstance(raw, bool):
                return raw
            if isinstance(raw, str) and raw.strip().lower() in ("1", "true", "yes", "on"):
                return True
            if isinstance(raw, str) and raw.strip().lower() in ("0", "false", "no", "off"):
                return False
            raise self.error(raw)
        if self.kind == "choice":
            if isinstance(raw, str) and raw.strip().lower() in self.choices:
                return raw.strip().lower()
            raise self.error(raw)
        if not isinstance(raw, str):
            raise self.error(raw)
        if self.kind in ("optional_str", "optional_path") and raw == "":
            return None
        if "\x00" in raw:
            raise SettingError(f"{self.flag}: expected {self.expectation()} without NUL bytes, got {raw!r}")
        if self.kind in ("path", "optional_path"):
            if raw.strip() == "":
                raise SettingError(f"{self.flag}: expected a path, got an empty value")
            return os.path.expanduser(raw)
        return raw

    def error(self, raw: Any) -> SettingError:
        shown = raw if isinstance(raw, str) else repr(raw)
        return SettingError(f'{self.flag}: expected {self.expectation()}, got "{shown}"')

    def _check_bounds(self, value: float, raw: Any) -> float:
        if self.minimum is not None and value < self.minimum:
            raise self.error(raw)
        if self.maximum is not None and value > self.maximum:
            raise self.error(raw)
        return value


def _bounds_text(lo: float | None, hi: float | None) -> str:
    def fmt(x: float) -> str:
        return str(int(x)) if float(x).is_integer() else str(x)

    if lo is not None and hi is not None:
        return f" from {fmt(lo)} to {fmt(hi)}"
    if lo is not None:
        return f" >= {fmt(lo)}"
    if hi is not None:
        return f" <= {fmt(hi)}"
    return ""


def _parse_int(raw: Any) -> int | None:
    if isinstance(raw, bool):
        return None
    if isinstance(raw, int):
        return raw
    if isinstance(raw, float) and raw.is_integer():
        return int(raw)
    if isinstance(raw, str):
        text = raw.strip()
        if text.lstrip("+-").isdigit():
            return int(text)
    return None


def _parse_float(raw: Any) -> float | None:
    if isinstance(raw, bool):
        return None
    if isinstance(raw, int | float):
        value = float(raw)
    elif isinstance(raw, str):
        try:
            value = float(raw.strip())
        except ValueError:
            return None
    else:
        return None
    return value if math.isfinite(value) else None


def setting(default: Any, **kwargs: Any) -> Any:
    """A dataclass field whose metadata is its Setting declaration."""
    return field(default=default, metadata={"setting": Setting(**kwargs)})
