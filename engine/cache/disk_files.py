"""The disk tier's file names and the file-system calls it makes on them: what a name of ours looks like, removing a
file (saying why not), fsyncing one, locking the folder, and a failed call in an operator's words.

Names this tier owns (and the only files it ever removes): `blk-<32 hex>.safetensors` (one block's state parts, shared by
every conversation that contains it), `conv-<16 hex>.safetensors` (a conversation: its token ids and the state parts of
its last partial block; its full blocks are the `blk-*` files named by its chained keys), temp files
`.<one of those>.tmp-<pid>-<hex>`, and `strata-cache.lock`. Any other `blk-*`/`conv-*` `.safetensors` name
(`conv-hacked-9.safetensors`) is malformed and removed; anything else in the folder is never touched.
"""

from __future__ import annotations

import errno
import logging
import os
import re

log = logging.getLogger("strata.cache")

BLOCK_RE = re.compile(r"^blk-([0-9a-f]{32})\.safetensors$")
CONV_RE = re.compile(r"^conv-([0-9a-f]{16})\.safetensors$")
OURS_RE = re.compile(r"^(blk|conv)-.*\.safetensors$")
LOCK_NAME = "strata-cache.lock"


def block_name(key: str) -> str:
    """The file name of the block with chained key `key` (what `BLOCK_RE` matches)."""
    return f"blk-{key}.safetensors"


def conv_name(conv_id: str) -> str:
    """The file name of conversation `conv_id`'s manifest (what `CONV_RE` matches)."""
    return f"conv-{conv_id}.safetensors"


def os_reason(exc: BaseException) -> str:
    """A failed file operation in words an operator can search for, without the path: the errno's name and the
    system's message ('ENOSPC (No space left on device)'); another exception's type and message."""
    if isinstance(exc, OSError) and exc.errno is not None:
        name = errno.errorcode.get(exc.errno, f"errno {exc.errno}")
        return f"{name} ({exc.strerror or os.strerror(exc.errno)})"
    return f"{type(exc).__name__} ({exc})"


def unlink(path: str) -> bool:
    """Remove `path`; True when it is gone (or was never there), False when it could not be removed (logged)."""
    return not unlink_error(path)


def unlink_error(path: str) -> str:
    """Remove `path`; "" when it is gone (or was never there), else why it could not be removed (logged)."""
    try:
        os.unlink(path)
        return ""
    except FileNotFoundError:
        return ""
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__  # str(exc) would name the path: callers name the file
        log.warning("conversation cache: cannot remove %s: %s", path, reason)
        return reason


def fsync_path(path: str) -> None:
    """Make a written file's contents durable."""
    fd = os.open(path, os.O_RDWR | getattr(os, "O_BINARY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


if os.name == "nt":  # pragma: no cover - exercised on Windows only
    import msvcrt

    def lock_file(fd: int) -> None:
        """Take the folder's lock without waiting; OSError when another process holds it."""
        msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)  # type: ignore[attr-defined]  # Windows-only names

    def unlock_file(fd: int) -> None:
        """Give the folder's lock back."""
        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)  # type: ignore[attr-defined]

else:
    import fcntl

    def lock_file(fd: int) -> None:
        """Take the folder's lock without waiting; OSError when another process holds it."""
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def unlock_file(fd: int) -> None:
        """Give the folder's lock back."""
        fcntl.flock(fd, fcntl.LOCK_UN)
