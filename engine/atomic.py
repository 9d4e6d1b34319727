"""Atomic file publication: write under a temp name in the same folder, fsync, rename, fsync the folder.

A crash at any moment leaves either the old state or the complete new file under its real name, plus possibly a
temp file whose name `is_temp_name` recognises so the next start-up removes it.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12 on

_TEMP_RE = re.compile(r"^\..+\.tmp-\d+-[0-9a-f]{8}$")


def temp_path(final_path: str) -> str:
    """A temp name beside `final_path`, recognisable by `is_temp_name`, unique per process and call."""
    folder, base = os.path.split(final_path)
    return os.path.join(folder, f".{base}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


def is_temp_name(name: str) -> bool:
    """True for a basename that `temp_path` could have produced."""
    return bool(_TEMP_RE.match(name))


def fsync_dir(folder: str) -> None:
    """Make renames in `folder` durable (a no-op where directories cannot be opened, i.e. Windows)."""
    if os.name == "nt":
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, chunks: Iterable[Buffer]) -> int:
    """Write every buffer in `chunks` to `fd` (looping over short writes); returns bytes written."""
    total = 0
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        while view:
            n = os.write(fd, view)
            total += n
            view = view[n:]
    return total


def write_temp(final_path: str, chunks: Iterable[Buffer], *, fsync: bool = True) -> tuple[str, int]:
    """Write `chunks` to a fresh temp file beside `final_path`; returns (temp path, bytes). Removes it on error."""
    tmp = temp_path(final_path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    fd = os.open(tmp, flags, 0o644)
    try:
        n = write_all(fd, chunks)
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        _unlink_quietly(tmp)
        raise
    os.close(fd)
    return tmp, n


def publish(pairs: list[tuple[str, str]], *, sync_dirs: bool = True) -> None:
    """Rename each fsynced (temp, final) pair into place, then fsync their folders once each."""
    for tmp, final in pairs:
        os.replace(tmp, final)
    if sync_dirs:
        for folder in sorted({os.path.dirname(final) or "." for _, final in pairs}):
            fsync_dir(folder)


def atomic_write(path: str, chunks: Iterable[Buffer]) -> int:
    """Write `path` atomically and durably; returns bytes written. Nothing is left under `path` on failure."""
    tmp, n = write_temp(path, chunks)
    try:
        publish([(tmp, path)])
    except BaseException:
        _unlink_quietly(tmp)
        raise
    return n


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
