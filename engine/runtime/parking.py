"""Moving conversations between the slots and the cache (engine thread): parking what a slot holds, and restoring
a parked conversation into a slot, here or through a read off this thread (engine/runtime/pending_restores.py).

The scheduler decides what moves (engine/runtime/scheduler.py); this does the moving, and every failure ends as
a clean miss: the slot emptied, the reason returned, the request prefilled.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from engine.runtime.control import CacheControl
from engine.runtime.draft_states import DraftRead, DraftStates
from engine.runtime.pending_restores import Looked, PendingRestores
from engine.runtime.slot_choice import MIN_PARK_TOKENS
from engine.runtime.slot_set import SlotSet
from engine.runtime.state import Slot
from engine.runtime.stats import EngineStats

if TYPE_CHECKING:
    from engine.cache.restores import RestoreRead
    from engine.cache.stats import CacheHit

log = logging.getLogger("strata.engine")


class Parking:
    """Parks and restores slots through the cache `control` holds (which is never None when asked to)."""

    def __init__(self, slots: SlotSet, control: CacheControl, restores: PendingRestores, stats: EngineStats,
                 draft: DraftStates | None = None) -> None:
        self.slots = slots
        self.control = control
        self.restores = restores
        self.stats = stats
        self.draft = draft  # --spec draft: the draft's rows, parked and restored beside the slot's
        self._draft_reads: dict[int, DraftRead | None] = {}  # slot -> the draft part a background restore awaits

    def park_if_losing(self, slot: Slot, keep: int, protect: str | None = None,
                       draft_protect: str | None = None) -> None:
        """Park the slot's conversation if reusing only `keep` of its tokens would throw the rest away.

        `protect` names a parked conversation this park must not evict (the hit about to be restored),
        `draft_protect` its draft part.
        """
        if self.control.cache is None or len(slot.tokens) <= keep or len(slot.tokens) < MIN_PARK_TOKENS:
            return
        self.park(slot, protect, draft_protect)

    def park(self, slot: Slot, protect: str | None = None, draft_protect: str | None = None) -> None:
        cache = self.control.cache
        assert cache is not None
        tokens = list(slot.tokens)
        reader, checkpoints = self.slots.memory.park_parts(slot.id, len(tokens), len(slot.prompt))
        try:
            result = cache.park(tokens, reader, keep=protect, attrs=slot.attrs, checkpoints=checkpoints)
        except Exception:  # the cache must never take a request down
            log.exception("parking slot %d failed", slot.id)
            return
        if not result.parked:
            log.info("slot %d: %d tokens not parked: %s", slot.id, len(tokens), result.reason)
            return
        assert result.conversation_id is not None
        self.stats.requests.assign(slot.unnamed, result.conversation_id)
        slot.conversation_id, slot.unnamed = result.conversation_id, []
        if self.draft is not None:
            self.draft.park(slot.id, tokens, result.conversation_id, keep=draft_protect)

    def _draft_hit(self, prompt: list[int]) -> CacheHit | None:
        return self.draft.lookup(prompt) if self.draft is not None else None

    def read_in_background(self, slot: Slot, looked: Looked) -> str | None:
        """Park the slot's contents and start reading the hit off this thread; None when the read began (the
        slot is restoring until `delivered` hands it back), else why the hit failed its checks (the slot is
        empty: the request starts at once, a clean miss)."""
        cache = self.control.cache
        assert cache is not None
        hit = looked.hit
        draft_hit = self._draft_hit(looked.request.prompt_tokens)  # found before the park, which must keep it
        self.park_if_losing(slot, 0, protect=hit.conversation_id,
                            draft_protect=draft_hit.conversation_id if draft_hit else None)
        slot.tokens = []
        try:
            read = cache.begin_restore(hit)
        except Exception as exc:
            log.warning("restore of conversation %s failed, prefilling instead: %s", hit.conversation_id, exc)
            self.slots.forget(slot)
            return str(exc) or type(exc).__name__
        n, sid = hit.n_tokens, slot.id
        try:
            if self.draft is not None:  # read beside the model's part
                self._draft_reads[slot.id] = self.draft.begin(draft_hit, background=True)
            self.restores.start(slot, read, looked, self.stats.counters["generated_tokens"],
                                prepare=lambda: self.slots.kv.populate(sid, 0, n))
        except Exception as exc:  # not started: nothing may stay pinned, and the request prefills
            log.exception("starting the restore of conversation %s failed, prefilling instead", hit.conversation_id)
            read.abandon()
            self._draft_reads.pop(slot.id, None)
            self.slots.forget(slot)
            return str(exc) or type(exc).__name__
        looked.stream.mark_started()  # it has its slot: the queue timeout no longer applies
        return None

    def delivered(self) -> Iterator[tuple[Slot, Looked, int, str, dict[str, Any]]]:
        """Each finished background read copied into its slot, no longer restoring: (slot, what was looked up,
        tokens restored, why not when 0, how the read went)."""
        for p in self.restores.ready():
            try:
                if p.dropped:
                    self._draft_reads.pop(p.slot.id, None)
                    reused, failed = 0, "its conversation was purged or deleted while it was read"
                else:
                    reused, failed = self.restore(p.slot, p.context.hit, p.context.request.prompt_tokens, p.read)
            except Exception as exc:  # what restore does not turn into a clean miss itself (a transfer, the draft)
                log.exception("delivering the restore into slot %d failed", p.slot.id)
                self.slots.forget(p.slot)  # whatever part of it arrived: the request prefills in full instead
                reused, failed = 0, f"delivering the restore failed: {exc}"
            p.slot.restoring = False
            if reused:
                self.restores.persist(p.read)
            read = {"ms": round(p.read.read_ms, 3),
                    "tokens_meanwhile": self.stats.counters["generated_tokens"] - p.tokens_at_start}
            yield p.slot, p.context, reused, failed, read

    def restore(self, slot: Slot, hit: CacheHit, prompt: list[int], read: RestoreRead | None = None) -> tuple[int, str]:
        """Park the slot's contents, then restore `hit` into it: (tokens restored, "") or, on any failure, a clean
        miss: (0, why). With `read` (a finished background read) the slot was parked when the read began."""
        cache = self.control.cache
        assert cache is not None
        if read is None:
            draft_hit = self._draft_hit(prompt)  # found before the park, which must keep it
            self.park_if_losing(slot, 0, protect=hit.conversation_id,
                                draft_protect=draft_hit.conversation_id if draft_hit else None)
            slot.tokens = []
            draft_read = None
        else:
            # begun beside the model's read; that read unpins it, delivered or not
            draft_hit, draft_read = None, self._draft_reads.pop(slot.id, None)
        assert not slot.tokens and slot.active is None, "restoring into a slot that holds or serves something"

        def write_kv(start: int, data: torch.Tensor) -> None:
            """Queue a restored piece into the slot; wait for all transfers once the last piece is queued."""
            self.slots.kv.write(slot.id, start, data, wait=False)
            if start + data.shape[2] >= hit.n_tokens:
                self.slots.kv.synchronize()

        writer = self.slots.memory.restore_writer(slot.id, write_kv)
        try:
            result = cache.restore(hit, writer) if read is None else read.deliver(writer, persist_use=False)
        except Exception as exc:
            log.warning("restore of conversation %s failed, prefilling instead: %s", hit.conversation_id, exc)
            self.slots.forget(slot)
            return 0, str(exc) or type(exc).__name__
        n = min(result.n_tokens, len(prompt) - 1)
        held = self.slots.memory.resumes_at(slot.id, n)
        if n <= 0 or held != n:
            # A restore that leaves the prefill to start elsewhere than where it restored reuses nothing: a bug
            # to see (llama.cpp #25913), not a silent full prefill.
            log.warning("restore of conversation %s did not resume at %d tokens (state at %d); prefilling "
                        "from token 0", hit.conversation_id, n, held)
            self.stats.counters["restores_without_reuse"] += 1
            self.slots.forget(slot)
            return 0, f"the restored state is at {held} tokens, not at the {n} restored"
        slot.tokens = list(prompt[:n])
        if self.draft is not None:  # the draft's part fails alone: the model's restore stands
            if read is None:  # begun only now: a begun restore holds its blocks until read
                draft_read = self.draft.begin(draft_hit, background=False)
            self.draft.deliver(slot.id, draft_read, prompt)
        return n, ""
