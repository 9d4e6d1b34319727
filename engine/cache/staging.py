"""The staging bound: the RAM held by disk writes not done yet never exceeds `spill_queue_bytes`.

Part of the disk store (it reads the store's index and drops its pending entries through the store); kept
apart because it is the one rule about RAM in a tier that is otherwise about files. Dropped pending writes are
counted in `spill_dropped` and logged. Pending writes are dropped in the cache's eviction order (lowest
priority first, oldest first within one), and never one of a higher priority than the write making room. Every method
runs with the cache's lock held.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from engine.cache.parts import parts_nbytes
from engine.cache.policy import eviction_order, rank_of

if TYPE_CHECKING:
    from engine.cache.disk_store import DiskStore
    from engine.cache.index import Conv

log = logging.getLogger("strata.cache")


class StagingBound:
    def __init__(self, store: DiskStore) -> None:
        self._store = store

    @property
    def limit(self) -> int:
        return self._store.settings.spill_queue_bytes

    def pending_bytes(self) -> int:
        """RAM held by entries and blocks waiting for the writer."""
        idx = self._store.index
        total = sum(parts_nbytes(b.data) for b in idx.blocks.values() if not b.on_disk)
        return total + sum(parts_nbytes(c.tail) for c in idx.convs.values() if not c.on_disk)

    def any_pending(self) -> bool:
        return any(not c.on_disk for c in self._store.index.convs.values())

    def drop_pending(self, conv: Conv, reason: str) -> None:
        """Remove a pending (unwritten) entry; the written version it replaced, if any, comes back."""
        idx = self._store.index
        prev = conv.previous
        if prev is None:
            self._store.remove(conv.id, reason=reason)
            return
        token = "\x00previous"
        idx.reserve(prev.keys, token)  # its blocks outlive the pending entry that held them
        conv.previous = None
        self._store.remove(conv.id, reason=reason)
        if prev.id not in idx.convs:
            idx.add(prev, [])
        idx.release(prev.keys, token)

    def make_room(self, nbytes: int, protect: set[str], rank: int) -> bool:
        """Make `nbytes` more fit the bound by dropping pending writes (not in `protect`, none of a priority above `rank`).

        False, with nothing dropped, when even dropping every droppable one would not be enough."""
        if nbytes > self.limit:
            return False
        store = self._store
        idx = store.index
        over = self.pending_bytes() + nbytes - self.limit
        gone: set[str] = set()
        freed_keys: set[str] = set()
        plan: list[Conv] = []
        for conv in eviction_order(idx.convs.values()):
            if over <= 0:
                break
            if conv.on_disk or conv.id in protect or idx.is_pinned(conv) or rank_of(conv.priority) > rank:
                continue
            plan.append(conv)
            gone.add(conv.id)
            over -= parts_nbytes(conv.tail)
            for k in conv.keys:
                blk = idx.blocks[k]
                if k not in freed_keys and blk.data is not None and not blk.on_disk and blk.holders <= gone:
                    freed_keys.add(k)
                    over -= parts_nbytes(blk.data)
        if over > 0:
            return False
        for conv in plan:
            self._drop(conv, "disk write queue full; dropped pending write of %s (%d tokens)")
        return True

    def bound(self, keep: str) -> None:
        """Drop pending writes while the RAM they hold exceeds the bound: never one of a higher priority than
        `keep` (the write just queued), which goes itself when only such writes are left."""
        store = self._store
        idx = store.index
        rank = rank_of(idx.convs[keep].priority)
        while self.pending_bytes() > self.limit:
            victim = next(
                (
                    c
                    for c in eviction_order(idx.convs.values())
                    if not c.on_disk and c.id != keep and not idx.is_pinned(c) and rank_of(c.priority) <= rank
                ),
                None,
            )
            if victim is None:
                conv = idx.convs.get(keep)
                if conv is not None and not conv.on_disk and not idx.is_pinned(conv):
                    store.journal.refused("priority")
                    self._drop(conv, "spill queue full of writes of a higher priority; dropped pending spill of %s (%d tokens)")
                return
            self._drop(victim, "spill queue full; dropped pending spill of %s (%d tokens)")

    def _drop(self, conv: Conv, message: str) -> None:
        self._store.journal.count("spill_dropped")
        log.warning("conversation cache: " + message, conv.id, conv.n_tokens)
        self.drop_pending(conv, "spill_drop")
