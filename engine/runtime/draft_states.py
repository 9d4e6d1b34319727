"""A draft's own state parked with the conversation: the draft model's K/V (`--spec draft`), or the next-token
layer's K/V and the target's hidden rows it reads (`--spec mtp`). When a slot's conversation is parked, the draft
rows it holds for the same tokens are parked too, and restored with it, so a switch-back drafts at once instead
of re-reading the conversation into the draft. Either draft is a `DraftRows`: what this module needs of it.

The draft's rows live in a conversation cache of their own (`CacheControl.draft_cache`), keyed by the draft model's
identity (chained block keys from it, its own subfolder on disk), under a share of the same budgets: deduplicated by
block, evicted, written to disk, adopted after a restart and split over stages like the model's own K/V, with every
check a restore makes. A draft part that is missing (evicted, never parked), foreign (another draft model: another
identity, so never found) or damaged (its checksum refused) fails alone: the model's restore stands and the draft
re-reads the tokens it lacks at its next draft (engine/runtime/draft_model.py keys its rows by tokens held), so the
answer is the same either way.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from engine.cache.identity import CacheIdentity
from engine.cache.parts import PartSpec
from engine.kv import KVLayout
from engine.runtime.control import CacheControl
from engine.runtime.draft_model import DraftModel
from engine.runtime.identity import cache_identity, int4_kernel
from engine.runtime.memory import AttentionMemory
from engine.runtime.mtp_drafts import MtpSource
from engine.runtime.reader_thread import ReaderThread

if TYPE_CHECKING:
    from engine.cache.parts import Parts
    from engine.cache.restores import RestoreRead
    from engine.cache.stats import CacheHit

log = logging.getLogger("strata.engine")

DRAFT_PARTS_KEPT = 4096  # the conversations whose draft part a drop takes with them, the most recently parked


def draft_identity(draft: DraftModel, block_tokens: int) -> CacheIdentity:
    """The draft model's own cache identity (as the model's is built), marked as a draft's: the same model as its
    own draft keeps its draft rows apart from its parked conversations."""
    loaded = draft.loaded
    identity = cache_identity(loaded, loaded.weights_format, int4_kernel(draft.model, loaded.weights_format),
                              draft.kv.layout, block_tokens, AttentionMemory(draft.kv))
    return dataclasses.replace(identity, model={**identity.model, "role": "draft"})


def mtp_identity(model: CacheIdentity, source: MtpSource) -> CacheIdentity:
    """The next-token layer's cache identity: the model's own (the layer's weights are the model file's), marked
    as the layer's, with its K/V (one float32 layer) as the layout and the target's hidden rows as a second
    per-token part (`MtpSource.read_rows`)."""
    kv_heads, head_dim = source.block.kv_shape
    hidden = PartSpec("hidden", "hidden_rows", source.dtype, (-1, source.block.config.hidden_size), 0)
    return CacheIdentity({**model.model, "role": "mtp"}, KVLayout(1, kv_heads, head_dim, torch.float32),
                         model.block_tokens, extra_parts=(hidden,))


class DraftRows(Protocol):
    """A draft's state per slot as the cache parks it (engine thread only): `DraftModel`, `MtpSource`."""

    def parkable(self, slot: int, tokens: Sequence[int]) -> int:
        """How many of `tokens` (the slot's, being parked) the slot's draft state covers, to park."""
        ...

    def read_rows(self, slot: int, start: int, end: int) -> Parts:
        """The slot's draft state of tokens [start, end), every part in host memory."""
        ...

    def forget(self, slot: int) -> None:
        """The slot's draft state is about to be overwritten: it holds nothing until `restored`."""
        ...

    def write_rows(self, slot: int, start: int, parts: Parts) -> None:
        """Write restored parts into the slot from token `start` on."""
        ...

    def restored(self, slot: int, tokens: Sequence[int]) -> None:
        """The slot's draft state now holds `tokens` (every part written)."""
        ...

    def restored_without(self, slot: int) -> None:
        """The model's part was restored into the slot without this draft's (none found, or refused)."""
        ...


@dataclass(slots=True)
class DraftRead:
    """A draft part being read (on the draft's reader thread when `future` is set, else at delivery)."""

    hit: CacheHit
    read: RestoreRead
    future: concurrent.futures.Future[None] | None


class DraftStates:
    """Parks and restores the draft's rows of a slot beside the model's (engine thread only, but for the reads
    of draft parts, which run on a thread of their own while the model's part is read on its reader)."""

    def __init__(self, draft: DraftRows, control: CacheControl) -> None:
        self.draft = draft
        self.control = control
        self.restored = self.refused = 0  # draft parts restored, and those that failed (the draft re-read them)
        self._reader = ReaderThread("strata-draft-read")  # a daemon: a hung read does not hold the exit

    def lookup(self, prompt: Sequence[int]) -> CacheHit | None:
        """The draft part parked for the longest prefix of `prompt`, or None."""
        cache = self.control.draft_cache
        if cache is None:
            return None
        try:
            return cache.lookup(prompt)
        except Exception:  # the draft's cache must never take a request down
            log.exception("looking up the draft's parked rows failed")
            return None

    def park(self, slot: int, tokens: Sequence[int], conversation_id: str, keep: str | None = None) -> None:
        """Park the draft's rows of `slot` for the prefix of `tokens` (the model's parked tokens, conversation
        `conversation_id`) they hold; `keep`: a draft part this park must not evict (the one about to be restored
        into the slot)."""
        cache = self.control.draft_cache
        if cache is None:
            return
        try:
            n = self.draft.parkable(slot, tokens)
            if n < 2:
                return
            result = cache.park(list(tokens[:n]), lambda a, b: self.draft.read_rows(slot, a, b), keep=keep)
        except Exception:
            log.exception("parking the draft's rows of slot %d failed", slot)
            return
        if not result.parked:
            log.info("slot %d: the draft's %d tokens not parked: %s", slot, n, result.reason)
            return
        assert result.conversation_id is not None
        parts = self.control.draft_parts
        parts.pop(conversation_id, None)
        parts[conversation_id] = result.conversation_id  # the most recent last
        while len(parts) > DRAFT_PARTS_KEPT:  # long evicted, most likely: the draft cache's eviction takes those
            del parts[next(iter(parts))]

    def begin(self, hit: CacheHit | None, background: bool) -> DraftRead | None:
        """Start restoring the draft part `hit` (a `lookup`'s): its checks now, its read on the draft's reader
        thread when `background` (beside the model's read of a disk hit), else at `deliver`. None when there is
        nothing to restore or its checks failed (the draft then re-reads what it lacks)."""
        cache = self.control.draft_cache
        if cache is None or hit is None:
            return None
        try:
            read = cache.begin_restore(hit)
        except Exception as exc:
            self._refused(hit, exc)
            return None
        return DraftRead(hit, read, self._reader.submit(read.read) if background else None)

    def deliver(self, slot: int, pending: DraftRead | None, prompt: Sequence[int]) -> int:
        """Write the draft part `begin` started into `slot` (engine thread); the tokens the draft holds then, 0
        when there was none or it failed (the draft re-reads what it lacks)."""
        if pending is None:
            self.draft.restored_without(slot)
            return 0
        self.draft.forget(slot)
        try:
            if pending.future is None:
                pending.read.read()
            else:
                pending.future.result()  # smaller than the model's part, read beside it: done nearly always
            result = pending.read.deliver(lambda start, parts: self.draft.write_rows(slot, start, parts),
                                          persist_use=False)
        except Exception as exc:
            self._refused(pending.hit, exc)
            self.draft.restored_without(slot)
            return 0
        self._reader.submit(pending.read.persist_use)  # a disk entry's manifest rewrite: a file write, off here
        n = min(result.n_tokens, len(prompt))
        self.draft.restored(slot, prompt[:n])
        self.restored += 1
        return n

    def replaced(self, slot: int) -> None:
        """The slot's K/V was written or emptied with no draft part (a slot file restored, the slot erased): the
        draft must not take what it holds for the slot's context (the next-token layer's target rows would)."""
        self.draft.restored_without(slot)

    def _refused(self, hit: CacheHit, exc: Exception) -> None:
        self.refused += 1
        log.warning("the draft's part of conversation %s was not restored (the draft re-reads it): %s",
                    hit.conversation_id, exc)

    def close(self, spill: bool, deadline_s: float) -> None:
        """Close the draft's cache (after the model's slots were parked, the draft's rows with them)."""
        if not self._reader.shutdown(wait=True, timeout=deadline_s):
            log.warning("a read of the draft's parked rows still hangs at shutdown: left behind")
        if self.control.draft_cache is not None:
            self.control.draft_cache.close(spill=spill, deadline_s=deadline_s)
