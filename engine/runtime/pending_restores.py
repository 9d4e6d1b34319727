"""Restores whose read runs off the engine thread, so the other slots keep decoding while one conversation is
read back from disk or copied onto a GPU.

The engine thread decides a restore (the cache's read-only lookup, `begin_restore`'s checks and pins) and parks
what the chosen slot held; a reader thread then reads and verifies the parked pieces (file reads and xxhash
release the GIL); the slot meanwhile is *restoring*: not free, not in the batch, its K/V rows untouched. When the
read is done the reader wakes the engine thread, which at the top of its next loop copies the pieces into the
slot (a memcpy into pages the reader already faulted in, `KVBuffers.populate`: first-touch faults made the copy
of 114 MiB take 272 ms instead of 49 ms; `RestoreRead.deliver`) and starts the request, which then prefills what is past the restore; the
reader then rewrites the entry's manifest with its new last use and hits (a file write and an fsync, which on a
busy disk took longer than the read). A failed read is a clean miss for that slot only.

When the slot's K/V lives on a CUDA device the copy into it is no memcpy (through the engine's pinned
staging a 1.44 GB conversation held the engine thread 47-53 ms on an H200), so there RAM restores take this
path too and the reader also delivers: it issues the host->device copies on a copy stream and waits for them
(engine/kv/stream_upload.py); the slot joins once the copies' events say they landed, the main stream ordered
after them. A hybrid model's restores (recurrent state written through the engine's slot states) and restores
into CPU slots are delivered on the engine thread as above.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from engine.cache.parts import kv_writer
from engine.kv.stream_upload import SlotUpload, StreamUploads
from engine.runtime.reader_thread import ReaderThread

if TYPE_CHECKING:
    from engine.cache.explain import LookupReport
    from engine.cache.restores import RestoreRead
    from engine.cache.stats import CacheHit
    from engine.kv.buffers import KVBuffers
    from engine.runtime.explain import Candidate
    from engine.runtime.requests import GenerationRequest
    from engine.runtime.state import Slot
    from engine.runtime.stream import RequestStream

log = logging.getLogger("strata.engine")
# One reader (ReaderThread): restores queue behind each other, never compete for the disk or the cores.


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
    upload: SlotUpload | None = None  # the copies into a GPU slot, issued by the reader
    dropped: bool = False  # its conversation was purged or deleted meanwhile: not delivered (a clean miss)


def _read_then(read: RestoreRead, prepare: Callable[[], None] | None, upload: SlotUpload | None) -> None:
    read.read()
    if prepare is not None and read.error is None:  # only a speed-up: on failure the copy faults the pages in
        _logged(prepare, "preparing slot pages for a restore failed")
    if upload is not None:
        read.deliver_early(kv_writer(upload.write), upload.finish)


def _logged(fn: Callable[[], None], what: str) -> None:
    try:
        fn()
    except Exception:  # on the reader nobody waits for the result: say it in the log
        log.exception(what)


class PendingRestores:
    """The slots whose restore is being read, and the reader thread (engine thread only, but for the reader)."""

    def __init__(self, wake: Callable[[], None], kv: KVBuffers | None = None) -> None:
        """`kv`: the K/V buffers of an attention-only model, whose restores the reader delivers when a stage
        is on a CUDA device (then `all_off_thread`)."""
        self._wake = wake  # puts something into the engine's inbox, so a blocked loop notices a finished read
        self._uploads = StreamUploads(kv) if kv is not None and StreamUploads.wanted(kv) else None
        self._pool: ReaderThread | None = None
        self._pending: dict[int, Pending] = {}

    def __len__(self) -> int:
        return len(self._pending)

    @property
    def all_off_thread(self) -> bool:
        """Whether RAM restores go through here too (their copy into the slot is a host->device transfer)."""
        return self._uploads is not None

    def start(self, slot: Slot, read: RestoreRead, context: Looked, tokens_now: int,
              prepare: Callable[[], None] | None = None) -> None:
        """Read `read` in the background, then, if it succeeded, run `prepare` there too (fault in the slot's
        pages, so the copy on the engine thread is a plain memcpy), and with a GPU stage deliver it there; `slot`
        is restoring until `ready()` hands it back."""
        assert slot.active is None and not slot.restoring and slot.id not in self._pending, slot.id
        assert not slot.tokens, "a restoring slot holds nothing until its data arrived"
        if self._pool is None:
            self._pool = ReaderThread("strata-restore")
        upload = None if self._uploads is None else self._uploads.begin(slot.id)
        future = self._pool.submit(_read_then, read, prepare, upload)
        # restoring once the read is under way: a failure before leaves the slot free (the caller prefills)
        slot.restoring = True
        future.add_done_callback(lambda _f: self._wake())
        self._pending[slot.id] = Pending(slot, read, future, context, tokens_now, upload)

    def drop(self, gone: Callable[[Looked], bool]) -> None:
        """The pending restores whose conversation `gone` says was purged or deleted: what their read got is not
        delivered (it is what the user asked to forget), and their requests prefill instead."""
        for p in self._pending.values():
            if gone(p.context):
                p.dropped = True

    def ready(self) -> list[Pending]:
        """The restores whose read is done (and whose copies into a GPU slot landed: polled, never waited for),
        no longer pending, the main streams ordered after their copies; their slots are restoring until the
        caller delivers them and sets `slot.restoring = False`."""
        done = [p for p in self._pending.values()
                if p.future.done() and (p.upload is None or p.upload.landed())]
        for p in done:
            del self._pending[p.slot.id]
            assert p.read.done, "the reader finished without completing the read"
            if p.upload is not None:
                p.upload.join()
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
            hung = any(not p.future.done() for p in left)
            # Manifest rewrites queued behind the reads land before the cache closes, unless a read still hangs
            # past the deadline (a stalled network disk): then the shutdown does not wait on it, nor on them.
            self._pool.shutdown(wait=not hung)
            self._pool = None
        return left
