"""Fault points for the kill -9 tests: a forked child SIGKILLs itself at a seeded point inside a file operation."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable


def arm_fault_points(target: int, armed: Callable[[], bool], *, unlinks: bool = False) -> None:
    """In a child: SIGKILL this process at the `target`-th fault point counted while `armed()` is true.

    Fault points lie inside every file write of the cache: halfway through each buffer written to a temp file,
    between buffers, before and after each rename that publishes a file, and before each folder fsync; with
    `unlinks`, also before and after each file removal (purge, eviction, the start-up scan)."""
    from engine import atomic

    count = [0]
    real_write_all, real_replace, real_fsync_dir, real_unlink = atomic.write_all, os.replace, atomic.fsync_dir, os.unlink

    def fault() -> None:
        if armed():
            if count[0] == target:
                os.kill(os.getpid(), signal.SIGKILL)
            count[0] += 1

    def write_all(fd, chunks):
        total = 0
        for chunk in chunks:
            view = memoryview(chunk).cast("B")
            half = len(view) // 2
            fault()
            total += real_write_all(fd, [view[:half]])
            fault()
            total += real_write_all(fd, [view[half:]])
        return total

    def replace(src, dst):
        fault()
        real_replace(src, dst)
        fault()

    def fsync_dir(folder):
        fault()
        real_fsync_dir(folder)

    def unlink(path, *args, **kwargs):
        fault()
        real_unlink(path, *args, **kwargs)
        fault()

    atomic.write_all, os.replace, atomic.fsync_dir = write_all, replace, fsync_dir
    if unlinks:
        os.unlink = unlink
