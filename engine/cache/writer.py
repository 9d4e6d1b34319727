"""The background disk writer: writes one claimed entry at a time, oldest first, and reports the result.

It owns only its queue. The disk store hands it entry ids (`submit`); for each, the writer asks the store to
`claim` it (under the cache's lock: the store moves it PENDING -> WRITING and pins its blocks), writes the
job's block files and manifest without any lock, and hands a `WriteResult` back through `report` (under the
lock again). It never reads or changes the store's index itself.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.cache.disk_files import os_reason
from engine.cache.disk_tier import DiskTier
from engine.cache.index import Conv, History
from engine.cache.parts import Parts
from engine.kv.host_memory import return_free_memory


@dataclass(slots=True)
class WriteJob:
    """What one write needs: the entry (read-only here), its unwritten blocks' (key, state parts), and its tail."""

    conv: Conv
    items: list[tuple[str, Parts | None]]
    tail: Parts | None
    extra: object = None  # the store's own bookkeeping for this job (the blocks it pinned)
    # `Conv.history` as of the claim, what the manifest records: the entry may be used (or its attributes
    # changed) while it is written
    history: History | None = None


@dataclass(slots=True)
class WriteResult:
    job: WriteJob
    error: str = ""  # empty: every file was published; else `os_reason`'s words (ENOSPC (No space left on device))
    sizes: dict[str, int] = field(default_factory=dict)  # block key -> file bytes, for the files published
    manifest_bytes: int = 0
    ms: float = 0.0


class DiskWriter(threading.Thread):
    def __init__(
        self,
        lock: threading.RLock,
        files: DiskTier,
        claim: Callable[[str], WriteJob | None],
        report: Callable[[WriteResult], None],
    ) -> None:
        super().__init__(name="strata-cache-writer", daemon=True)
        self.cond = threading.Condition(lock)
        self._files = files
        self._claim = claim
        self._report = report
        self._queue: deque[str] = deque()
        self._busy = False
        self._stopping = False

    def submit(self, conv_id: str) -> None:
        with self.cond:
            self._queue.append(conv_id)
            self.cond.notify_all()

    def forget(self, conv_id: str) -> None:
        with self.cond, contextlib.suppress(ValueError):
            self._queue.remove(conv_id)

    def drain(self, deadline: float) -> bool:
        """Wait until nothing is queued or being written, or until `deadline` (monotonic); True when idle."""
        with self.cond:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(min(left, 0.5))
            return True

    def stop(self, deadline: float) -> None:
        with self.cond:
            self._stopping = True
            self._queue.clear()
            self.cond.notify_all()
        self.join(timeout=max(deadline - time.monotonic(), 0) + 1)

    def run(self) -> None:
        while True:
            with self.cond:
                while not self._queue and not self._stopping:
                    self.cond.wait()
                if self._stopping:
                    return
                job = self._claim(self._queue.popleft())
                if job is None:
                    continue
                self._busy = True
            result = self._write(job)
            with self.cond:
                self._report(result)
                self._busy = False
                self.cond.notify_all()
            # The job holds the parked tensors: no reference may outlive the write, or a disk park keeps its whole
            # copy in RAM until the next job comes (what `disk` storage exists to avoid).
            job.items, job.tail = [], None
            del job, result
            if not self._queue:
                return_free_memory()  # the freed copies' pages go back now, not at some later allocation

    def _write(self, job: WriteJob) -> WriteResult:
        t0 = time.perf_counter()
        result = WriteResult(job)
        try:
            if any(t is None for _, t in job.items):
                raise RuntimeError("a pending block lost its RAM copy")
            result.sizes = self._files.write_blocks(job.items)
            result.manifest_bytes = self._files.write_manifest(job.conv, job.tail, history=job.history)
        except Exception as exc:  # disk full, read-only folder, ...: the write is dropped, never the engine
            result.error = os_reason(exc)
        result.ms = (time.perf_counter() - t0) * 1000
        return result
