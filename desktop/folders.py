"""Checking a folder a setting names: the nearest existing part, whether it is writable, the free space."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FolderReport:
    """What a folder check found: the folder that exists (itself or its nearest parent), writable, free bytes."""

    path: str
    existing: str
    writable: bool
    free_bytes: int | None


def check_folder(path: str) -> FolderReport:
    """Blocking (disk access): run off the GUI thread."""
    probe = os.path.abspath(os.path.expanduser(path))
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    writable = os.path.isdir(probe) and os.access(probe, os.W_OK | os.X_OK)
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        free = None
    return FolderReport(path, probe, writable, free)
