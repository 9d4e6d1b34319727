"""Giving freed heap pages back to the system."""

from __future__ import annotations

import contextlib
import ctypes
import sys


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc keeps what many small objects freed, e.g. the
    GGUF reader's, and what large tensors freed once its mmap threshold has grown, counted in RSS); a no-op
    elsewhere."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):  # not glibc (musl)
            ctypes.CDLL("libc.so.6").malloc_trim(0)
