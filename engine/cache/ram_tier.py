"""The RAM tier: owns the RAM index (blocks with their state parts, conversations in LRU order) and its budget.

A park captures only the blocks the tier does not hold yet, under the RAM byte budget, the slot count and the
host-memory floor. An evicted conversation is handed to `on_evict` (tiered: queued for the disk writer). Every
method runs on the engine thread with the cache's lock held where it says so.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable

import numpy as np
import psutil

from engine.cache.attrs import ConvAttrs
from engine.cache.errors import CacheRestoreError, ParkRefused
from engine.cache.identity import CacheIdentity
from engine.cache.index import Block, Conv, TierIndex
from engine.cache.journal import Journal
from engine.cache.parts import NO_CHECKPOINTS, Checkpoints, Parts, ReadParts, check_parts, parts_nbytes
from engine.cache.policy import RoomPlan, plan_room, rank_of
from engine.cache.settings import CacheSettings

log = logging.getLogger("strata.cache")
MIB = 1 << 20
RESERVED = "\x00park"  # holder token of blocks reserved by a park in progress
OnEvict = Callable[[Conv, dict[str, Parts | None]], None]


def capture(identity: CacheIdentity, read_parts: ReadParts, start: int, end: int) -> Parts:
    """Every state part of tokens [start, end) as contiguous host tensors; refuses any other shape."""
    try:
        return check_parts(identity.parts, read_parts(start, end), end - start)
    except ValueError as exc:
        raise ParkRefused("read_error", f"the slot's state for tokens [{start}, {end}): {exc}") from None


def refuse_room(plan: RoomPlan, where: str) -> ParkRefused:
    """The refusal of a park `plan_room` found no room for ("priority" or "no_room")."""
    if plan.refused == "priority":
        return ParkRefused(
            "priority",
            f"no room {where}: only conversations of a higher priority (or pinned) would have to go",
        )
    return ParkRefused("no_room", f"no room {where}: the conversations that would have to go are in use")


def inherit(superseded: list[Conv]) -> tuple[str, float, int]:
    """Id, creation time and hits of the conversation line a park continues (or a fresh id)."""
    if not superseded:
        return secrets.token_hex(8), time.time(), 0
    latest = max(superseded, key=lambda c: c.last_used)
    return latest.id, min(c.created for c in superseded), sum(c.hits for c in superseded)


class RamTier:
    def __init__(
        self,
        settings: CacheSettings,
        identity: CacheIdentity,
        lock: threading.RLock,
        journal: Journal,
        on_evict: OnEvict,
    ) -> None:
        self.settings = settings
        self.identity = identity
        self.index = TierIndex("ram")
        self.lock = lock
        self.journal = journal
        self._on_evict = on_evict

    def park(
        self, toks: np.ndarray, keys: list[str], read_parts: ReadParts, keep: str | None, attrs: ConvAttrs,
        states: Checkpoints = NO_CHECKPOINTS,
    ) -> tuple[Conv, int, int]:
        """Park in RAM; returns (entry, new bytes, evictions). Raises ParkRefused; nothing changed then."""
        s, idx, b = self.settings, self.index, self.identity.block_tokens
        bpt = self.identity.bytes_per_token
        with self.lock:
            superseded = idx.prefixes_of(toks)
            resolved = attrs.resolve(superseded)
            same = [c for c in superseded if c.n_tokens == len(toks)]
            if same:
                same[0].set_attrs(resolved)
                same[0].last_used = time.time()
                idx.touch(same[0].id)
                return same[0], 0, 0
            have = idx.matched_blocks(keys)
            states = states.settled(have, lambda i: idx.blocks[keys[i]].state, b)
            n_tail = len(toks) - len(keys) * b
            sb = self.identity.state_bytes
            own = n_tail * bpt + toks.nbytes + states.own_bytes
            need = (len(keys) - have) * self.identity.block_bytes + states.new_blocks(have) * sb + own
            total = len(keys) * self.identity.block_bytes + len(states.blocks) * sb + own
            if total > s.ram_bytes:
                raise ParkRefused(
                    "larger_than_budget",
                    f"{total / MIB:.1f} MiB conversation is larger than the whole RAM budget ({s.ram_bytes / MIB:.0f} MiB)",
                )
            available = psutil.virtual_memory().available
            if available - need < s.min_free_bytes:
                raise ParkRefused(
                    "floor",
                    f"parking {need / MIB:.1f} MiB would leave {max(available - need, 0) / MIB:.0f} MiB of host memory "
                    f"available, under the {s.min_free_bytes / MIB:.0f} MiB floor",
                )
            plan = plan_room(
                idx,
                need_bytes=need,
                budget=s.ram_bytes,
                slots=s.slots,
                keep_keys=set(keys),
                leaving={c.id for c in superseded},
                exclude={keep} if keep else set(),
                rank=rank_of(resolved[0]),
            )
            if not plan.ok:
                raise refuse_room(plan, "in RAM")
            victims = plan.victims
            idx.reserve(keys[:have], RESERVED)
            for cid in victims:
                self.evict(cid)
        new_blocks: list[Block] = []
        tail = None
        try:
            for i in range(have, len(keys)):
                data = capture(self.identity, read_parts, i * b, (i + 1) * b)
                if i in states.blocks:  # the checkpoint at this block's end is stored with it
                    data = {**data, **states.blocks[i]}
                new_blocks.append(Block(keys[i], parts_nbytes(data), data=data, state=i in states.blocks))
            if n_tail:
                tail = capture(self.identity, read_parts, len(keys) * b, len(toks))
        except ParkRefused:
            with self.lock:
                idx.release(keys[:have], RESERVED)
            raise
        except Exception as exc:
            with self.lock:
                idx.release(keys[:have], RESERVED)
            log.exception("conversation cache: reading the slot's K/V failed")
            raise ParkRefused("read_error", f"reading the slot's K/V failed: {exc}") from None
        with self.lock:
            conv_id, created, hits = inherit(superseded)
            for old in superseded:
                idx.remove(old.id)
                if old.id != conv_id:
                    self.journal.redirect(old.id, conv_id)
            conv = Conv(conv_id, toks, keys, own, tail=tail, created=created, last_used=time.time(), hits=hits,
                        checkpoints=dict(states.own))
            conv.set_attrs(resolved)
            idx.add(conv, new_blocks)
            idx.release(keys[:have], RESERVED)
        new_bytes = sum(blk.nbytes for blk in new_blocks) + parts_nbytes(tail) + states.own_bytes
        return conv, new_bytes, len(victims)

    def data_of(self, conv: Conv) -> dict[str, Parts | None]:
        return {k: self.index.blocks[k].data for k in conv.keys}

    def evict(self, conv_id: str, *, spill: bool = True, reason: str = "evict") -> int:
        """Drop a RAM conversation (handing it to `on_evict` when `spill`); returns the RAM bytes freed.

        Caller holds the lock."""
        idx = self.index
        conv = idx.convs[conv_id]
        tensors = self.data_of(conv)
        before = idx.bytes
        self.journal.losses.dropped(conv.tokens, conv_id, reason, "ram", slots_full=len(idx.convs) >= self.settings.slots)
        idx.remove(conv_id)
        freed = before - idx.bytes
        if reason == "evict":
            self.journal.count("evictions")
        self.journal.event(reason, conv_id, conv.n_tokens, freed, 0.0, "ram")
        if spill:
            self._on_evict(conv, tensors)
        return freed

    def take(self, conv_id: str) -> tuple[Conv, dict[str, Parts | None]]:
        """Remove a conversation to move it to another tier (not an eviction: nothing is counted)."""
        conv = self.index.convs[conv_id]
        tensors = self.data_of(conv)
        self.index.remove(conv_id)
        return conv, tensors

    def enforce_budget(self) -> None:
        """Evict conversations in eviction order until the tier is within its budget and slot count (caller holds
        the lock)."""
        s = self.settings
        on = s.uses_ram
        plan = plan_room(
            self.index,
            need_bytes=0,
            budget=s.ram_bytes if on else 0,
            slots=s.slots if on else 0,
            keep_keys=set(),
            leaving=set(),
            exclude=set(),
            adding=0,
            in_flight_ok=True,
            best_effort=True,
        )
        for cid in plan.victims:
            self.evict(cid)

    def purge(self) -> tuple[int, int]:
        """Drop every conversation (nothing is spilled); returns (conversations, bytes). Caller holds the lock."""
        dropped = freed = 0
        for cid in list(self.index.convs):
            freed += self.evict(cid, spill=False, reason="purge")
            dropped += 1
        return dropped, freed

    def pieces(
        self, conv: Conv, blocks: list[Block], use_tail: bool, own_state: int | None = None
    ) -> tuple[list[tuple[int, Parts]], int, Parts | None]:
        """(start, state parts) pieces of a restore, the bytes they hold, and the conversation's own checkpoint at
        `own_state` (a hybrid model's restore that ends there); raises CacheRestoreError."""
        b = self.identity.block_tokens
        pieces: list[tuple[int, Parts]] = []
        for i, blk in enumerate(blocks):
            if blk.data is None:
                raise CacheRestoreError(f"block {blk.key[:12]} of {conv.id} has no data")
            pieces.append((i * b, blk.data))
        if use_tail:
            if conv.tail is None:
                raise CacheRestoreError(f"conversation {conv.id} has no tail data")
            pieces.append((len(conv.keys) * b, conv.tail))
        state = None
        if own_state is not None:
            state = conv.checkpoints.get(own_state)
            if state is None:
                raise CacheRestoreError(f"conversation {conv.id} has no checkpoint at {own_state}")
        return pieces, sum(parts_nbytes(p) for _, p in pieces) + parts_nbytes(state), state
