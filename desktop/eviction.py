"""What a settings change would evict, estimated before it is applied (as Purge says what it drops).

This replays the engine's eviction (engine/cache/policy.py `eviction_order`, engine/cache/reconfigure.py) on its
last list of conversations (`/cache/conversations`, merged one row per conversation), tier by tier: each tier's
budget and slot count take conversations unpinned before pinned, low before normal before high priority, least
recently used first within those, until what is left fits. A switch to disk storage writes every RAM
conversation to disk, and a tiered RAM budget writes what it pushes out; each is written on its own, making room
as a spill does. The figures are an estimate: the engine may have parks in flight and entries the list has not
shown yet, blocks two conversations share are counted in each, and a conversation written to disk is counted at
its RAM size (its files add a header and alignment to each block).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from desktop.monitor.conversations import ParkedConversation
from desktop.settings import SUMMED_BYTES, format_bytes, format_mib

MIB = 1 << 20
BUDGETS = {"ram": "conversation_cache_mib", "disk": "conversation_cache_disk_mib"}
SLOTS = "conversation_cache_slots"  # the most conversations each tier keeps


@dataclass(frozen=True, slots=True)
class Eviction:
    """Conversations a change would push out of one tier."""

    where: str  # "ram" or "disk"
    count: int
    bytes: float
    of: int  # how many are there now, with those the change writes there
    limit: str  # the new budget, in words
    spilled: bool = False  # tiered RAM evictions are written to disk, not lost
    ids: tuple[str, ...] = field(default=(), compare=False)  # which ones, in the order they go


PRIORITY_RANK = {"low": 0, "normal": 1, "high": 2}
Sized = dict[str, tuple[ParkedConversation, float]]  # id -> (conversation, its bytes in the tier)


def _eviction_order(rows: list[ParkedConversation]) -> list[ParkedConversation]:
    """The engine's order: unpinned before pinned, low before normal before high, least recently used first."""
    return sorted(rows, key=lambda r: (r.row.pinned, _rank(r), r.last_used))


def _rank(row: ParkedConversation) -> int:
    return PRIORITY_RANK.get(row.row.priority, 1)


def _room(held: Sized, budget: float, slots: int, adding: float | None = None,
          rank: int | None = None) -> list[str] | None:
    """The ids `held` gives up, in the engine's order (engine/cache/policy.py `plan_room`), so that it fits `budget`
    bytes and `slots` entries with one more entry of `adding` bytes and priority rank `rank` (an entry of a higher
    rank is passed over), or, with nothing added, as far as it can. None when an addition cannot be made to fit."""
    total = sum(size for _, size in held.values()) + (adding or 0.0)
    count = len(held) + (adding is not None)
    gone = []
    for row in _eviction_order([r for r, _ in held.values()]):
        if total <= budget and count <= slots:
            break
        if rank is not None and _rank(row) > rank:
            continue
        gone.append(row.id)
        total -= held[row.id][1]
        count -= 1
    if adding is not None and (total > budget or count > slots):
        return None
    return gone


def _limit(budget_mib: float, slots: int, slots_changed: bool) -> str:
    most = f", at most {slots} conversation{'s' if slots != 1 else ''}" if slots_changed else ""
    return format_mib(budget_mib) + most


def estimate(rows: list[ParkedConversation], storage: str, running: dict[str, Any],
             changes: dict[str, Any]) -> list[Eviction]:
    """What applying `changes` (field -> new value) to an engine running `running` in `storage` would evict from
    `rows`, tier by tier as the engine does (engine/cache/reconfigure.py): RAM first, within its budget and slot
    count; then each conversation written to disk, one at a time, making room there as a spill does (it may push
    out only conversations of its priority or below, and is dropped itself when that is not enough); then the disk
    tier's own budget. A tier is weighed when its budget or the slot count shrinks or conversations move into it
    (a switch to disk storage, a tiered RAM budget's overflow): the list's sums are not the engine's own (shared
    blocks), so an unchanged tier is not second-guessed."""
    out: list[Eviction] = []
    new_storage = str(changes.get("conversation_cache_storage", storage))
    used_tiers = {"ram": ("ram",), "disk": ("disk",), "tiered": ("ram", "disk")}.get(new_storage, ())
    # a disk budget of 0 leaves the disk unused: its files stay for a later return, and nothing is written there
    disk_used = "disk" in used_tiers and changes.get(BUDGETS["disk"], running.get(BUDGETS["disk"], 0)) > 0
    slots = int(changes.get(SLOTS, running.get(SLOTS, 0)))
    slots_shrink = SLOTS in changes and changes[SLOTS] < running.get(SLOTS, 0)

    def budget_of(tier: str) -> tuple[float, bool]:
        key = BUDGETS[tier]
        mib = changes.get(key, running.get(key, 0))
        return mib, slots_shrink or (key in changes and changes[key] < running.get(key, 0))

    def in_tier(tier: str) -> Sized:
        return {r.id: (r, float(r.bytes_by_tier[tier])) for r in rows if tier in r.tiers}

    # conversations written to disk by this change, in the order they are written: every RAM one, least recently
    # used first, when the storage becomes disk alone
    arriving = sorted((r for r in rows if "ram" in r.tiers), key=lambda r: r.last_used) \
        if new_storage == "disk" and storage != "disk" and disk_used else []
    if "ram" in used_tiers:
        mib, shrinks = budget_of("ram")
        held = in_tier("ram")
        if shrinks:
            gone = _room(held, mib * MIB, slots) or []
            if gone:
                spilled = new_storage == "tiered" and disk_used
                out.append(Eviction("ram", len(gone), sum(held[i][1] for i in gone), len(held),
                                    _limit(mib, slots, slots_shrink), spilled=spilled, ids=tuple(gone)))
                if spilled:  # each evicted one is handed to the disk as it goes
                    arriving = [held[i][0] for i in gone]
    if disk_used:
        mib, shrinks = budget_of("disk")
        held = in_tier("disk")
        if shrinks or arriving:
            there = set(held)
            lost: list[tuple[ParkedConversation, float]] = []
            for row in arriving:
                there.add(row.id)
                size = float(row.bytes_by_tier["ram"])
                old = held.pop(row.id, None)  # a copy already on disk is superseded by what is written now
                if old is not None and old[1] >= size:
                    held[row.id] = old  # the same (or more) already there: nothing is written
                    continue
                gone = _room(held, mib * MIB, slots, adding=size, rank=_rank(row))
                if gone is None:
                    lost.append((row, size))  # dropped: the disk copy it had, if any, stays
                    if old is not None:
                        held[row.id] = old
                    continue
                lost += [held.pop(i) for i in gone]
                held[row.id] = (row, size)
            lost += [held.pop(i) for i in _room(held, mib * MIB, slots) or []]
            if lost:
                out.append(Eviction("disk", len(lost), sum(size for _, size in lost), len(there),
                                    _limit(mib, slots, slots_shrink), ids=tuple(r.id for r, _ in lost)))
    return out


def describe(evictions: list[Eviction]) -> str:
    """The question to ask before applying, in words."""
    lines = []
    for e in evictions:
        what = f"{e.count} of {e.of} parked conversation{'s' if e.of != 1 else ''} ({format_bytes(e.bytes)})"
        if e.spilled:
            lines.append(f"• moves {what} from RAM to disk, to fit the RAM budget of {e.limit}.")
        else:
            place = "RAM" if e.where == "ram" else "disk"
            lines.append(f"• drops {what} from {place}, to fit the {place} budget of {e.limit}.")
    return ("Applying this change\n" + "\n".join(lines) + "\n\nLow priority before normal before high go first, "
            "pinned ones last, the least recently used first among those. This is an "
            "estimate from the engine's last list of conversations; dropped ones are prefilled again when they "
            "come back. " + SUMMED_BYTES)
