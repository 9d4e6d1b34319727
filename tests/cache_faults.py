"""Fault points for the kill -9 tests: a child process kills itself at a seeded point inside a file operation.

The children run in a fresh interpreter ("spawn", the only way Windows starts one) or forked where the platform
can fork (quicker: nothing is imported again); either way the child runs one module-level function with the
same arguments and reports over a pipe. Killing itself is SIGKILL on POSIX and TerminateProcess on Windows
(`os.kill` with any other number): both end the process at once, as a crash or a power cut of the process does.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import traceback
from collections.abc import Callable
from typing import Any

import pytest

KILL = getattr(signal, "SIGKILL", 9)  # on Windows the exit code TerminateProcess gives the child
SPAWN = "spawn"
FAST = "fork" if "fork" in multiprocessing.get_all_start_methods() else SPAWN
CHILD_TIMEOUT_S = 300.0

no_file_size_limit_on_windows = pytest.mark.skipif(
    sys.platform == "win32",
    reason="a failing write is made with RLIMIT_FSIZE (EFBIG past a size), which has no Windows equivalent",
)


def crash() -> None:
    """End this process at once, as kill -9 does: no buffer flushed, no exit handler run, no file closed."""
    os.kill(os.getpid(), KILL)


def crashed(exitcode: int | None) -> bool:
    """Whether a child's exit code (multiprocessing's: minus the signal number on POSIX) is `crash()`'s."""
    return exitcode == (KILL if sys.platform == "win32" else -KILL)


def run_child(target: Callable[..., int], *args: Any, method: str = FAST) -> tuple[int | None, list[str]]:
    """Run `target(report, *args)` in a child process; returns its exit code and the lines it reported, in order.

    `target` is a module-level function (a spawned child imports it by name); `report(line)` sends one line in
    one write, so a kill never leaves half of one. The child exits with what `target` returns, 3 when it raised.
    """
    context = multiprocessing.get_context(method)
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_child_main, args=(target, send, args), daemon=True)
    child.start()
    send.close()  # the child holds the only writing end: its end is the pipe's
    lines: list[str] = []
    try:
        while receive.poll(CHILD_TIMEOUT_S):
            try:
                lines.append(receive.recv_bytes().decode())
            except EOFError:
                break
        else:
            raise TimeoutError(f"{target.__name__} reported nothing for {CHILD_TIMEOUT_S:g} s")
    finally:
        receive.close()
        child.join(10)
        if child.is_alive():  # it hung: never leave it running
            child.kill()
            child.join()
    return child.exitcode, lines


def _child_main(target: Callable[..., int], send: Any, args: tuple) -> None:
    code = 3
    try:
        import torch

        torch.set_num_threads(1)
        code = target(lambda line: send.send_bytes(line.encode()), *args)
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)  # as a crash ends it: the cache is never closed


def arm_fault_points(target: int, armed: Callable[[], bool], *, unlinks: bool = False) -> None:
    """In a child: kill this process (`crash`) at the `target`-th fault point counted while `armed()` is true.

    Fault points lie inside every file write of the cache: halfway through each buffer written to a temp file,
    between buffers, before and after each rename that publishes a file, and before each folder fsync; with
    `unlinks`, also before and after each file removal (purge, eviction, the start-up scan)."""
    from engine import atomic

    count = [0]
    real_write_all, real_replace, real_fsync_dir, real_unlink = atomic.write_all, os.replace, atomic.fsync_dir, os.unlink

    def fault() -> None:
        if armed():
            if count[0] == target:
                crash()
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
