"""The Chat tab's conversations kept across launches, in one small JSON file in the app's data folder.

The engine keeps a conversation's K/V parked on disk across restarts, but only the client knows its messages:
without them a parked conversation can never be continued. The file holds each conversation's messages and the
figures of its turns; the next launch lists them, and a continued one's next turn sends the same messages again,
which the engine finds parked and restores instead of prefilling them.

Writes are atomic (`desktop.files.atomic_write`: temp file, fsync, rename), so a crash leaves the old file or
the new one. A file that cannot be read as transcripts is kept aside under another name (the user's words are
not overwritten by the next save) and the chats start empty, with the reason for the log.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import MISSING, asdict, fields
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, Signal

from desktop.chat_stream import TurnStats
from desktop.chat_tab import Conversation
from desktop.files import atomic_write

SCHEMA_VERSION = 1
ROLES = ("system", "user", "assistant")
STATS_FIELDS = {f.name for f in fields(TurnStats)}
STATS_NEEDED = {f.name for f in fields(TurnStats) if f.default is MISSING}


def to_json(conversations: list[Conversation]) -> str:
    data = {"schema": SCHEMA_VERSION, "conversations": [
        {"messages": c.messages, "stats": {str(i): asdict(s) for i, s in sorted(c.stats.items())}}
        for c in conversations if c.messages]}
    return json.dumps(data, ensure_ascii=False, indent=1) + "\n"


def from_json(text: str) -> list[Conversation]:
    """The conversations of a file's text; ValueError naming what is wrong with it."""
    data = json.loads(text)
    if not isinstance(data, dict) or not isinstance(data.get("conversations"), list):
        raise ValueError('expected an object with a "conversations" list')
    version = data.get("schema")
    if not isinstance(version, int) or not 1 <= version <= SCHEMA_VERSION:
        raise ValueError(f"unknown schema {version!r}")
    out = []
    for n, item in enumerate(data["conversations"]):
        messages = item.get("messages") if isinstance(item, dict) else None
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
                and isinstance(m.get("reasoning_content", ""), str) for m in messages):
            raise ValueError(f"conversation {n}: expected messages with a role and a text content "
                             "(and a thinking model's reasoning as text)")
        stats: dict[int, TurnStats] = {}
        figures = item.get("stats")
        for key, value in (figures.items() if isinstance(figures, dict) else ()):
            # Figures are a courtesy: one that does not fit is left out, the messages still count.
            if key.isdigit() and isinstance(value, dict) and _figures_fit(value):
                stats[int(key)] = TurnStats(**value)
        out.append(Conversation([{k: m[k] for k in ("role", "content", "reasoning_content") if k in m}
                                 for m in messages], stats))
    return out


def _figures_fit(value: dict[str, Any]) -> bool:
    """Whether a turn's stored figures can be shown: known names, numbers (or none) and a yes/no for stopped."""
    if not STATS_NEEDED <= set(value) <= STATS_FIELDS or not isinstance(value.get("stopped", False), bool):
        return False
    return all(v is None or (isinstance(v, int | float) and not isinstance(v, bool))
               for k, v in value.items() if k != "stopped") and value["total_s"] is not None


def keep_aside(path: Path) -> Path:
    """Rename a damaged file out of the way, so that the next save does not overwrite what it held."""
    aside = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
    n = 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}-{n}")
    os.replace(path, aside)
    return aside


def load_chats(path: Path) -> tuple[list[Conversation], str | None]:
    """The kept conversations (none when there is no file) and, when the file was refused, why."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return [], None
    except (OSError, UnicodeDecodeError) as e:
        return [], f"Could not read the chat transcripts {path}: {e}; the Chat tab starts empty."
    try:
        return from_json(text), None
    except ValueError as e:  # json.JSONDecodeError included
        try:
            where = f"it was kept as {keep_aside(path).name}"
        except OSError as moved:
            where = f"it could not be moved aside ({moved.strerror}) and will be replaced"
        return [], f"The chat transcripts {path} were damaged ({e}); {where} and the Chat tab starts empty."


class ChatKeeper(QObject):
    """Writes the transcripts off the GUI thread, one write at a time (the last text wins); `flush` at quit."""

    failed = Signal(str)

    def __init__(self, path: Path, submit: Callable[[Callable[[], Any], Callable[[Any], None]], None],
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.path, self._submit = path, submit
        self._pending: str | None = None
        self._written: str | None = None
        self._writing = False

    def load(self) -> tuple[list[Conversation], str | None]:
        conversations, problem = load_chats(self.path)
        self._written = None if problem else to_json(conversations)  # no file and no chats: nothing to write
        return conversations, problem

    def save_later(self, conversations: list[Conversation]) -> None:
        self._pending = to_json(conversations)
        self._next()

    def _next(self) -> None:
        # One write in flight at a time: two on the dispatcher's pool could land in either order.
        if self._writing or self._pending is None:
            return
        text, self._pending = self._pending, None
        if text == self._written:
            return
        self._writing = True
        self._submit(lambda: atomic_write(self.path, text), lambda result: self._written_one(text, result))

    def _written_one(self, text: str, result: Any) -> None:
        self._writing = False
        if isinstance(result, BaseException):
            self.failed.emit(f"could not save the chat transcripts to {self.path}: {result}")
        else:
            self._written = text
        self._next()

    def flush(self, conversations: list[Conversation]) -> None:
        """Write now, on this thread (at quit, once the background writer has stopped)."""
        text = to_json(conversations)
        self._pending = None
        if text == self._written:
            return
        try:
            atomic_write(self.path, text)
            self._written = text
        except OSError as e:
            self.failed.emit(f"could not save the chat transcripts to {self.path}: {e}")
