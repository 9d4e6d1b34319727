"""The desktop's persisted settings: engine settings (read through `engine.config`) plus the app's own preferences.

An effective engine value comes from one of three places, in rising priority: the default declared in
`engine.config`, the settings file, or an environment variable `STRATA_<FIELD>` (e.g. `STRATA_PORT=9000`).
`SettingsStore.source()` says which, so the Settings tab can show it and lock what the environment overrides.
The file holds only what the user changed from a default, so a new default reaches everyone who never
touched that value. Writes are atomic (temp file, fsync, rename) and skipped when nothing changed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from enum import StrEnum
from pathlib import Path
from typing import Any

import platformdirs
from PySide6.QtCore import QObject, QTimer, Signal

from desktop.files import atomic_write
from engine.config import APP_NAME, EngineConfig, all_settings, setting_of
from engine.setting import Setting, SettingError
from engine.store_url import redact_url

SCHEMA_VERSION = 1
SETTINGS_FILE = "desktop-settings.json"
PID_FILE = "engine.pid"
CHATS_FILE = "chats.json"
ENV_PREFIX = "STRATA_"
# Settings the Settings tab does not show: an alias of storage=tiered + dir, kept for the seeds' command lines.
HIDDEN_SETTINGS = ("conversation_cache_spill_dir",)


class Source(StrEnum):
    """Where an effective value comes from."""

    DEFAULT = "default"
    FILE = "settings file"
    ENV = "environment"


@dataclass(frozen=True, slots=True)
class Paths:
    """Folders the app reads and writes; tests pass temporary ones."""

    config_dir: Path
    state_dir: Path
    log_dir: Path | None = None  # None: a "logs" folder in state_dir
    data_dir: Path | None = None  # None: state_dir (tests and --state-dir keep everything in one folder)

    @classmethod
    def default(cls) -> Paths:
        return cls(
            config_dir=Path(platformdirs.user_config_dir(APP_NAME, appauthor=False)),
            state_dir=Path(platformdirs.user_state_dir(APP_NAME, appauthor=False)),
            log_dir=Path(platformdirs.user_log_dir(APP_NAME, appauthor=False)),
            data_dir=Path(platformdirs.user_data_dir(APP_NAME, appauthor=False)),
        )

    @property
    def logs(self) -> Path:
        """Where the engine's and the app's log files go."""
        return self.log_dir if self.log_dir is not None else self.state_dir / "logs"

    @property
    def settings_file(self) -> Path:
        return self.config_dir / SETTINGS_FILE

    @property
    def pid_file(self) -> Path:
        return self.state_dir / PID_FILE

    @property
    def chats_file(self) -> Path:
        """The Chat tab's transcripts: the user's data, not state the app could rebuild."""
        return (self.data_dir if self.data_dir is not None else self.state_dir) / CHATS_FILE


@dataclass(slots=True)
class AppPrefs:
    """The desktop app's own preferences (not engine flags)."""

    close_to_tray: bool = True  # closing the window keeps the engine serving while a tray is available
    tray_notice_shown: bool = False  # the first-time "still running in the tray" notice was shown
    start_engine: bool = True  # start the engine when the app starts
    auto_restart: bool = False  # restart a crashed engine, with back-off


def env_name(field_name: str) -> str:
    """The environment variable that overrides `field_name`."""
    return ENV_PREFIX + field_name.upper()


def parse_mib(text: str, spec: Setting) -> int:
    """Parse a budget typed as MiB (default), GiB or TiB: "4096", "4 GiB", "1.5G", "512 MiB"; raise SettingError."""
    raw = text.strip()
    units = {"": 1, "m": 1, "mb": 1, "mib": 1, "g": 1024, "gb": 1024, "gib": 1024, "t": 1 << 20, "tb": 1 << 20,
             "tib": 1 << 20}
    number = raw.rstrip("abgimtBGIMT ").strip()
    unit = raw[len(number):].strip().lower()
    if unit not in units or not number:
        raise SettingError(f'{spec.flag}: expected a size in MiB or GiB (e.g. 4096 or 4 GiB), got "{text}"')
    try:
        value = float(number)
    except ValueError:
        raise SettingError(f'{spec.flag}: expected a size in MiB or GiB (e.g. 4096 or 4 GiB), got "{text}"') from None
    mib = value * units[unit]
    if not mib.is_integer() and unit in ("", "m", "mb", "mib"):
        raise spec.error(text)
    return int(spec.parse(round(mib)))


def format_mib(mib: float) -> str:
    """4096 -> "4 GiB", 1536 -> "1.5 GiB", 300 -> "300 MiB"."""
    if mib >= 1024:
        gib = mib / 1024
        return f"{gib:g} GiB" if round(gib, 2) == gib else f"{gib:.2f} GiB"
    return f"{mib:g} MiB"


def format_bytes(n: float | None) -> str:
    """Bytes in the largest binary unit that keeps the number readable."""
    if n is None:
        return "–"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


# Two ways the same parked bytes are counted, said wherever a figure could be compared with the other: a block
# (the K/V of a run of tokens) shared by conversations with the same start is stored once.
SUMMED_BYTES = ("Sizes are each conversation's own, added up: blocks that conversations share (the same start) "
                "are stored once, so the RAM and Disk bars, which count them once, can show less.")
UNIQUE_BYTES = "Bytes stored, a block that several conversations share counted once (the parked list's Size " \
               "counts it in each)."


def is_budget(spec: Setting) -> bool:
    """A size in MiB, typed in MiB or GiB (the setting's declared UI kind)."""
    return spec.ui == "size"


def secret_variable(flag: str) -> str:
    """The environment variable the shown command line reads a secret from: --api-key -> STRATA_API_KEY."""
    assert flag.startswith("--"), flag
    return "STRATA_" + flag[2:].upper().replace("-", "_")


# The shell a pasted command line meets: PowerShell on Windows (the default terminal since Windows 11), else a
# POSIX shell.
DEFAULT_SHELL = "powershell" if sys.platform == "win32" else "posix"
# Words PowerShell passes to a program as written; anything else (a comma makes an array, @ splats, $ expands,
# spaces split) is single-quoted.
_PLAIN_WORD = re.compile(r"[A-Za-z0-9_./:\\-]+")


def command_line(config: EngineConfig, *, mask_secrets: bool = True, program: str = "strata serve",
                 shell: str = DEFAULT_SHELL) -> str:
    """The `strata serve ...` command line equivalent to `config`, quoted for `shell` ("posix" or "powershell").

    With `mask_secrets` a secret's value is replaced by a variable the shell expands (`--api-key
    "$STRATA_API_KEY"`, in PowerShell `$env:STRATA_API_KEY`), so the line still works when pasted into a shell
    where that variable is set, and the secret itself never shows on screen or in a clipboard.
    """
    assert shell in ("posix", "powershell"), shell
    args = config.to_args()
    secret_flags = masked_flags(config) if mask_secrets else set()
    words = [program]
    for i, a in enumerate(args):
        if i > 0 and args[i - 1] in secret_flags:
            name = secret_variable(args[i - 1])
            words.append(f"$env:{name}" if shell == "powershell" else f'"${name}"')  # the shell must expand it
        elif shell == "powershell":
            # Single quotes take everything literally in PowerShell but a single quote, which is doubled.
            words.append(a if _PLAIN_WORD.fullmatch(a) else "'" + a.replace("'", "''") + "'")
        else:
            words.append(shlex.quote(a))
    return " ".join(words)


def masked_flags(config: EngineConfig) -> set[str]:
    """The flags a shown command line reads from a variable: secrets, and a store URL that carries a password."""
    return {spec.flag for name, spec, _ in all_settings()
            if spec.secret or (spec.url and redact_url(str(getattr(config, name))) != getattr(config, name))}


def set_variable_hint(name: str, shell: str = DEFAULT_SHELL) -> str:
    """How to set variable `name` before pasting the line, in `shell`'s words."""
    return f"$env:{name} = '…'" if shell == "powershell" else f"export {name}=…"


def secret_variables(config: EngineConfig) -> list[str]:
    """The variables a masked command line of `config` reads (empty when it carries no secret)."""
    args = config.to_args()
    secret_flags = masked_flags(config)
    return [secret_variable(args[i - 1]) for i in range(1, len(args)) if args[i - 1] in secret_flags]


def _migrate(data: dict[str, Any], version: int) -> dict[str, Any]:
    """Bring a file written with an older schema up to SCHEMA_VERSION (no older schema exists yet)."""
    assert version <= SCHEMA_VERSION, f"cannot migrate down from schema {version}"
    return data


class SettingsStore:
    """Engine settings and app preferences, loaded from and saved to one JSON file."""

    def __init__(self, path: Path, environ: Mapping[str, str] | None = None) -> None:
        self.path = path
        self.environ = dict(os.environ if environ is None else environ)
        self.values: dict[str, Any] = {}  # engine settings the user set (parsed), by field name
        self.prefs = AppPrefs()
        self.messages: list[str] = []  # what loading had to say (damaged file, dropped values, env overrides)
        self._env: dict[str, Any] = {}
        self._last_written: str | None = None
        self._read_env()

    # ------------------------------------------------------------------ sources

    def _read_env(self) -> None:
        for name, spec, _ in all_settings():
            raw = self.environ.get(env_name(name))
            if raw is None:
                continue
            try:
                self._env[name] = spec.parse(raw)
            except SettingError as e:
                self.messages.append(f"{env_name(name)} ignored: {e}")

    def source(self, name: str) -> Source:
        if name in self._env:
            return Source.ENV
        if name in self.values:
            return Source.FILE
        return Source.DEFAULT

    def describe_source(self, name: str) -> str:
        """One line for the Settings tab: where this value comes from."""
        src = self.source(name)
        if src is Source.ENV:
            return f"set by the environment variable {env_name(name)} (unset it to edit here)"
        if src is Source.FILE:
            return "from the settings file"
        return "default"

    def value(self, name: str) -> Any:
        """The effective value of one engine setting."""
        if name in self._env:
            return self._env[name]
        if name in self.values:
            return self.values[name]
        return getattr(EngineConfig(), name)

    def engine_config(self) -> EngineConfig:
        """The effective EngineConfig: defaults, then the file, then the environment."""
        merged = {**self.values, **self._env}
        return EngineConfig(**merged)

    # ------------------------------------------------------------------ changes

    def set(self, name: str, raw: Any) -> Any:
        """Validate and store one engine setting; return the parsed value. Raises SettingError with the reason."""
        spec = setting_of(name)
        if name in self._env:
            raise SettingError(f"{spec.flag}: set by the environment variable {env_name(name)}; unset it to change it here")
        value = spec.parse(raw)
        # Whole-config validation (e.g. aliases that rewrite other fields) must accept it too.
        EngineConfig(**{**self.values, **self._env, name: value})
        if value == getattr(EngineConfig(), name):
            self.values.pop(name, None)
        else:
            self.values[name] = value
        return value

    def reset(self, name: str) -> None:
        self.values.pop(name, None)

    def set_pref(self, name: str, value: bool) -> None:
        assert name in {f.name for f in fields(AppPrefs)}, f"unknown preference {name!r}"
        setattr(self.prefs, name, bool(value))

    # ------------------------------------------------------------------ file

    def to_json(self) -> str:
        data = {
            "schema": SCHEMA_VERSION,
            "engine": {k: self.values[k] for k in sorted(self.values)},
            "app": dataclasses.asdict(self.prefs),
        }
        return json.dumps(data, indent=2, sort_keys=False) + "\n"

    def load(self) -> list[str]:
        """Read the file. A damaged file is renamed aside and defaults are used; returns the messages for the user."""
        messages: list[str] = []
        self.values = {}
        self.prefs = AppPrefs()
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            self._last_written = None
            self.messages += messages
            return self.messages
        except OSError as e:
            messages.append(f"Could not read {self.path}: {e.strerror}; using defaults.")
            self.messages += messages
            return self.messages
        try:
            data = json.loads(text)
            if not isinstance(data, dict):
                raise ValueError("expected a JSON object at the top level")
            version = data.get("schema")
            if not isinstance(version, int) or version < 1:
                raise ValueError(f'expected a "schema" version number, got {version!r}')
            engine = data.get("engine", {})
            app = data.get("app", {})
            if not isinstance(engine, dict) or not isinstance(app, dict):
                raise ValueError('expected "engine" and "app" to be objects')
        except ValueError as e:
            aside = self._keep_aside()
            messages.append(f"The settings file {self.path} was damaged ({e}); it was kept as {aside.name} "
                            "and defaults are used.")
            self.messages += messages
            return self.messages
        if version > SCHEMA_VERSION:
            messages.append(f"{self.path.name} was written by a newer Strata Desktop (schema {version}); "
                            "settings this version knows were read, the others are dropped on the next save.")
        else:
            data = _migrate(data, version)
        known = {name for name, _, _ in all_settings()}
        for name, raw in engine.items():
            if name not in known:
                messages.append(f"Unknown setting {name!r} in {self.path.name} dropped.")
                continue
            try:
                value = setting_of(name).parse(raw)
            except SettingError as e:
                messages.append(f"{e}; the default is used instead.")
                continue
            if value != getattr(EngineConfig(), name):
                self.values[name] = value
        try:
            EngineConfig(**self.values)
        except SettingError as e:
            messages.append(f"{e}; engine settings reset to defaults.")
            self.values = {}
        for f in fields(AppPrefs):
            if isinstance(app.get(f.name), bool):
                setattr(self.prefs, f.name, app[f.name])
        self._last_written = text if not messages else None
        self.messages += messages
        return self.messages

    def _keep_aside(self) -> Path:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        aside = self.path.with_name(f"{self.path.name}.damaged-{stamp}")
        n = 1
        while aside.exists():
            n += 1
            aside = self.path.with_name(f"{self.path.name}.damaged-{stamp}-{n}")
        os.replace(self.path, aside)
        return aside

    def pending_text(self) -> str | None:
        """The file's new content when it differs from what was last written or read, else None."""
        text = self.to_json()
        return None if text == self._last_written else text

    def save(self) -> bool:
        """Write the file if anything changed; returns True when it wrote."""
        text = self.pending_text()
        if text is None:
            return False
        atomic_write(self.path, text)
        self._last_written = text
        return True

    def mark_written(self, text: str) -> None:
        self._last_written = text


class AutoSaver(QObject):
    """Saves the store a moment after the last change, writing off the UI thread; flush() writes now."""

    saved = Signal(str)  # path
    failed = Signal(str)  # message

    def __init__(self, store: SettingsStore, submit: Callable[[Callable[[], Any], Callable[[Any], None]], None],
                 delay_ms: int = 500, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.store = store
        self._submit = submit
        self._timer = QTimer(self, singleShot=True, interval=delay_ms)
        self._timer.timeout.connect(self._save_in_background)
        # One write at a time, the newest last: saves run on a pool of several workers, and flush() on this
        # thread; without this an older text could land after a newer one (and win at the next launch).
        self._writing = threading.Lock()
        self._asked = 0  # saves asked for, in order
        self._landed = 0  # the newest save written

    def schedule(self) -> None:
        self._timer.start()

    def _save_in_background(self) -> None:
        text = self.store.pending_text()
        if text is None:
            return
        path = self.store.path
        self._asked += 1
        seq = self._asked

        def write() -> bool:
            with self._writing:
                if seq < self._landed:
                    return False  # a newer text is on disk already
                atomic_write(path, text)
                self._landed = seq
                return True

        def done(result: Any) -> None:
            if isinstance(result, BaseException):
                self.failed.emit(f"Could not save settings to {path}: {result}")
                return
            if not result:
                return  # skipped: what is on disk is a newer text, which its own save marked
            self.store.mark_written(text)
            self.saved.emit(str(path))

        self._submit(write, done)

    def flush(self) -> None:
        """Write pending changes now, on this thread (used at quit)."""
        self._timer.stop()
        self._asked += 1
        seq = self._asked
        try:
            with self._writing:  # after a write under way, never before it
                if self.store.save():
                    self.saved.emit(str(self.store.path))
                self._landed = seq
        except OSError as e:
            self.failed.emit(f"Could not save settings to {self.store.path}: {e}")
