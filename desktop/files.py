"""Files the desktop app writes: whole or not at all, and changed again while Windows holds them open.

Windows refuses to replace or remove a file while another handle holds it without sharing deletion (a virus
scanner or an indexer reading it for a moment, an editor, the engine reading its settings): a sharing
violation, raised as PermissionError. POSIX lets both through, so there a PermissionError is a real lack of
permission and is not tried again.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

SHARING_RETRIES = 40
SHARING_RETRY_S = 0.025  # a reader's handle lives for one read: 40 tries wait about 1 s
SHARING_VIOLATIONS = os.name == "nt"


def while_shared(change: Callable[[], object], path: Path) -> None:
    """Remove or replace `path` by `change`, again while another process or thread holds it open for a moment where
    the OS refuses that (SHARING_VIOLATIONS). Anything else raises as it came; a file still held after
    SHARING_RETRIES tries raises PermissionError saying so."""
    for attempt in range(1, SHARING_RETRIES + 1):
        try:
            change()
            return
        except PermissionError as error:
            if not SHARING_VIOLATIONS:
                raise
            if attempt == SHARING_RETRIES:
                raise PermissionError(
                    error.errno, f"{path} could not be changed through {SHARING_RETRIES} tries over "
                    f"{SHARING_RETRIES * SHARING_RETRY_S:.1f} s ({error.strerror}): another program may hold it "
                    "open; close it and try again") from error
            time.sleep(SHARING_RETRY_S)


def atomic_write(path: Path, text: str, newline: str | None = None) -> None:
    """Write `text` to `path` so that a crash leaves either the old file or the new one, never half of one; the
    rename waits out a moment's hold on the old file (while_shared). A failure leaves no temporary file (a Startup
    folder must not collect stray files either). `newline` is open()'s: "" writes the text's line ends as they are
    (a .cmd's CRLF), None writes the platform's."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline=newline) as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        while_shared(lambda: os.replace(tmp, path), path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # directory fsync: not available on Windows
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
