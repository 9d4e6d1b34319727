"""The cache's decisions, free of I/O and locks: which hit is worth restoring, and which entries make room.

`decline_reason` weighs a hit against the user's thresholds and the restore cost model; `eviction_order` is the
one order in which every budget of every tier (RAM bytes, disk bytes, slot counts, the disk write buffer) takes
conversations: unpinned before pinned, low before normal before high, least recently used first within a class;
`plan_room` walks it to pick the entries to evict so one more entry fits a tier's byte budget and slot count,
never taking one of a higher priority than the entry being added (a pin only orders: a pinned conversation
goes when nothing unpinned that may go is left). They read the state they are given and change nothing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from engine.cache.attrs import PRIORITIES, HasAttrs
from engine.cache.identity import CacheIdentity
from engine.cache.index import Conv, TierIndex
from engine.cache.settings import CacheSettings

A = TypeVar("A", bound=HasAttrs)
Precedence = tuple[int, int]  # (pinned, priority rank): a larger value is kept longer


def rank_of(priority: str) -> int:
    """0 for low, 1 for normal, 2 for high: a park may evict only conversations of its rank or below."""
    return PRIORITIES.index(priority)


def precedence_of(priority: str, pinned: bool) -> Precedence:
    """Where a conversation stands in the eviction order: pinned after unpinned, then low < normal < high."""
    return (1 if pinned else 0, rank_of(priority))


def precedence(conv: HasAttrs) -> Precedence:
    return precedence_of(conv.priority, conv.pinned)


def eviction_order(convs: Iterable[A]) -> list[A]:
    """`convs` in the order budgets evict them: lowest precedence first, least recently used (`last_used`) first
    within a precedence. By the time, not by the index's order: a conversation spilled from RAM joins the disk's
    index last but was used when it was, and the Settings tab's estimate (desktop/eviction.py) replays this
    order from the listed times."""
    return sorted(convs, key=lambda c: (precedence(c), c.last_used))


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


@dataclass(frozen=True, slots=True)
class Verdict:
    """A hit weighed: why it is not worth restoring ("" = use it) and the cost model's two predictions."""

    reason: str  # "" | "n_min" | "similarity" | "cost"
    restore_s: float | None = None  # predicted time to read the hit's blocks (None: no prefill rate measured yet)
    prefill_s: float | None = None  # predicted time to prefill the tokens it would save

    def detail(self) -> dict[str, float]:
        """The predictions as a request explanation's detail (only those made)."""
        out = {}
        if self.restore_s is not None and self.prefill_s is not None:
            out = {"predicted_restore_s": self.restore_s, "predicted_prefill_s": self.prefill_s}
        return out


def decline_reason(
    settings: CacheSettings,
    identity: CacheIdentity,
    *,
    n: int,
    n_request: int,
    live_prefix: int,
    bandwidth: float,
    prefill_tokens_per_s: float | None,
) -> Verdict:
    """Whether a hit of `n` tokens is worth restoring: `Verdict.reason` is "n_min", "similarity", "cost" or "".

    Cost: reading whole blocks at the tier's measured `bandwidth` (bytes/s) must be faster than prefilling the
    tokens the slot does not already hold (`live_prefix`) at the measured prefill rate. The predictions are
    made whenever a prefill rate is known, so a hit declined for a threshold still says what it would have cost.
    """
    restore_s = prefill_s = None
    rate = prefill_tokens_per_s
    if rate and rate > 0:
        b = identity.block_tokens
        read_bytes = math.ceil(n / b) * b * identity.layout.bytes_per_token
        restore_s = read_bytes / bandwidth
        prefill_s = (n - max(live_prefix, 0)) / rate
    if settings.n_min and n < settings.n_min:
        return Verdict("n_min", restore_s, prefill_s)
    if settings.similarity and n / n_request < settings.similarity:
        return Verdict("similarity", restore_s, prefill_s)
    if restore_s is not None and prefill_s is not None and restore_s >= prefill_s:
        return Verdict("cost", restore_s, prefill_s)
    return Verdict("", restore_s, prefill_s)


@dataclass(slots=True)
class RoomPlan:
    """What `plan_room` found: the entries to evict, or why no choice of them makes room."""

    victims: list[str] = field(default_factory=list)
    refused: str = ""  # "" (room made), "priority" (only higher-priority entries would do) or "no_room"

    @property
    def ok(self) -> bool:
        return not self.refused


def plan_room(
    index: TierIndex,
    *,
    need_bytes: int,
    budget: int,
    slots: int,
    keep_keys: set[str],
    leaving: set[str],
    exclude: set[str],
    adding: int = 1,
    in_flight_ok: bool = False,
    best_effort: bool = False,
    rank: int | None = None,
) -> RoomPlan:
    """Entries of `index` to evict, in `eviction_order`, so `need_bytes` more fit `budget` and `adding` more
    entries fit `slots`.

    `leaving` are entries this operation removes anyway; `keep_keys` blocks stay (the new entry holds them).
    `in_flight_ok`: entries the writer is writing may be chosen too (the caller removes their files once the write
    ends); an entry a restore is reading (its `pins`) never is, whatever it says. `rank`: the priority rank (`rank_of`) of the entry being added; an entry of a higher priority is
    never chosen (None: any entry may go, as when a budget shrinks). When even evicting every candidate would
    not make room, the plan is refused and says why ("priority" when entries were passed over for their
    priority, else "no_room") and has no victims, unless `best_effort`, which keeps every victim that helps.
    """
    gone = set(leaving)
    freed_keys: set[str] = set()

    def freed_by(conv: Conv) -> int:
        total = conv.nbytes
        for k in conv.keys:
            blk = index.blocks[k]
            if k not in keep_keys and k not in freed_keys and blk.holders <= gone:
                freed_keys.add(k)
                total += blk.nbytes
        return total

    bytes_after = index.bytes + need_bytes
    for cid in leaving:
        if cid in index.convs:
            bytes_after -= freed_by(index.convs[cid])
    count_after = len([c for c in index.convs if c not in leaving]) + adding
    victims: list[str] = []
    outranked = False
    for conv in eviction_order(index.convs.values()):
        if bytes_after <= budget and count_after <= slots:
            break
        cid = conv.id
        if cid in gone or cid in exclude or conv.pins > 0 or (index.is_pinned(conv) and not in_flight_ok):
            continue
        if rank is not None and rank_of(conv.priority) > rank:
            outranked = True
            continue
        gone.add(cid)
        victims.append(cid)
        count_after -= 1
        bytes_after -= freed_by(conv)
    if bytes_after > budget or count_after > slots:
        refused = "priority" if outranked else "no_room"
        return RoomPlan(victims if best_effort else [], refused)
    return RoomPlan(victims)
