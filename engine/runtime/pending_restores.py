"""Restores whose read runs off the engine thread, so the other slots keep decoding while one conversation is
read back from disk.

The engine thread decides a restore (the cache's read-only lookup, `begin_restore`'s checks and pins) and parks
what the chosen slot held; a reader thread then reads and verifies the parked pieces (file reads and xxhash
release the GIL); the slot meanwhile is *restoring*: not free, not in the batch, its K/V rows untouched. When the
read is done the reader wakes the engine thread, which at the top of its next loop copies the pieces into the
slot (a memcpy into pages the reader already faulted in, `KVBuffers.populate`: first-touch faults made the copy
of 114 MiB take 272 ms instead of 49 ms; `RestoreRead.deliver`) and starts the request, which then prefills what is past the restore; the
reader then rewrites the entry's manifest with its new last use and hits (a file write and an fsync, which on a
busy disk took longer than the read). A failed read is a clean miss for that slot only.

The same shape fits the incoming side of a GPU transfer (the reader waits for a device-to-host or peer copy
instead of files); nothing else in the engine needs to change for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from engine.cache.explain import LookupReport
    from engine.cache.restores import RestoreRead
    from engine.cache.stats import CacheHit
    from engine.runtime.explain import Candidate
    from engine.runtime.requests import GenerationRequest
    from engine.runtime.state import Slot
    from engine.runtime.stream import RequestStream

log = logging.getLogger("strata.engine")
READERS = 1  # one reader: restores queue behind each other, never compete for the disk or the cores


class Looked(NamedTuple):
    """What admission saw and decided for a request whose hit is restored (handed back once it is read)."""

    request: GenerationRequest
    stream: RequestStream
    hit: CacheHit
    candidate: Candidate | None  # the free slot sharing the most of the prompt (for the record)
    report: LookupReport
    small_gain: bool


@dataclass(slots=True)
class Pending:
    """A slot waiting for its restore's read."""

    slot: Slot
    read: RestoreRead
    future: Future[None]
    context: Looked
    tokens_at_start: int  # the engine's generated-token count when the read started


def _read_then(read: RestoreRead, prepare: Callable[[], None] | None) -> None:
    read.read()
    if prepare is not None and read.error is None:  # only a speed-up: on failure the copy faults the pages in
        _logged(prepare, "preparing slot pages for a restore failed")


def _logged(fn: Callable[[], None], what: str) -> None:
    try:
        fn()
    except Exception:  # on the reader nobody waits for the result: say it in the log
        log.exception(what)


class PendingRestores:
    """The slots whose restore is being read, and the reader thread (engine thread only, but for the reader)."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake  # puts something into the engine's inbox, so a blocked loop notices a finished read
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[int, Pending] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def start(self, slot: Slot, read: RestoreRead, context: Looked, tokens_now: int,
              prepare: Callable[[], None] | None = None) -> None:
        """Read `read` in the background, then, if it succeeded, run `prepare` there too (fault in the slot's
        pages, so the copy on the engine thread is a plain memcpy); `slot` is restoring until `ready()` hands it
        back."""
        assert slot.active is None and not slot.restoring and slot.id not in self._pending, slot.id
        assert not slot.tokens, "a restoring slot holds nothing until its data arrived"
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=READERS, thread_name_prefix="strata-restore")
        slot.restoring = True
        future = self._pool.submit(_read_then, read, prepare)
        future.add_done_callback(lambda _f: self._wake())
        self._pending[slot.id] = Pending(slot, read, future, context, tokens_now)

    def ready(self) -> list[Pending]:
        """The restores whose read is done, no longer pending; their slots are restoring until the caller
        delivers them and sets `slot.restoring = False`."""
        done = [p for p in self._pending.values() if p.future.done()]
        for p in done:
            del self._pending[p.slot.id]
            assert p.read.done, "the reader finished without completing the read"
        return done

    def persist(self, read: RestoreRead) -> None:
        """Rewrite the restored entry's manifest (its last use, its hits) on the reader, not the engine thread."""
        assert self._pool is not None, "persist() after a read started the reader"
        self._pool.submit(_logged, read.persist_use, "recording a restore's use on disk failed")

    def wait(self, timeout: float | None = None) -> None:
        """Block until every pending read is done (a cache reconfigure or the shutdown)."""
        futures = [p.future for p in self._pending.values()]
        if futures:
            wait_futures(futures, timeout=timeout)

    def close(self, timeout: float = 30.0) -> list[Pending]:
        """Finish what is being read and stop the reader; returns the restores never delivered."""
        self.wait(timeout)
        left = list(self._pending.values())
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)  # manifest rewrites queued behind the reads land before the cache closes
            self._pool = None
        return left
