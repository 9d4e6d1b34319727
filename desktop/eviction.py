"""What a settings change would evict, estimated before it is applied (as Purge says what it drops).

This replays the engine's eviction (engine/cache/policy.py `eviction_order`) on its last list of conversations
(`/cache/conversations`, merged one row per conversation): every budget takes conversations unpinned before
pinned, low before normal before high priority, least recently used first within those, until what is left
fits. A switch to disk storage writes every RAM conversation to disk first (engine/cache/reconfigure.py), so they
count against the disk budget; RAM conversations a tiered RAM budget pushes out are written to disk too. The
figures are an estimate: the engine may have parks in flight, entries the list has not shown yet, and blocks
two conversations share (the list counts them in each).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from desktop.monitor.conversations import ParkedConversation
from desktop.settings import SUMMED_BYTES, format_bytes, format_mib

MIB = 1 << 20
BUDGETS = {"ram": "conversation_cache_mib", "disk": "conversation_cache_disk_mib"}
SLOTS = "conversation_cache_slots"


@dataclass(frozen=True, slots=True)
class Eviction:
    """Conversations a change would push out of one place."""

    where: str  # "ram", "disk", or "slots" (the most conversations kept)
    count: int
    bytes: float
    of: int  # how many are there now
    limit: str  # the new budget, in words
    spilled: bool = False  # tiered RAM evictions are written to disk, not lost


PRIORITY_RANK = {"low": 0, "normal": 1, "high": 2}


def _eviction_order(rows: list[ParkedConversation]) -> list[ParkedConversation]:
    """The engine's order: unpinned before pinned, low before normal before high, least recently used first."""
    return sorted(rows, key=lambda r: (r.row.pinned, PRIORITY_RANK.get(r.row.priority, 1), r.last_used))


def _evict(sizes: dict[str, tuple[ParkedConversation, float]], budget: float) -> list[tuple[ParkedConversation, float]]:
    """The conversations taken, in the engine's order, until what `sizes` holds fits `budget` bytes."""
    total = sum(size for _, size in sizes.values())
    gone = []
    for row in _eviction_order([r for r, _ in sizes.values()]):
        if total <= budget:
            break
        size = sizes[row.id][1]
        gone.append((row, size))
        total -= size
    return gone


def estimate(rows: list[ParkedConversation], storage: str, running: dict[str, Any],
             changes: dict[str, Any]) -> list[Eviction]:
    """What applying `changes` (field -> new value) to an engine running `running` in `storage` would evict from
    `rows`. A tier is weighed when its budget shrinks or conversations move into it (a switch to disk storage, a
    tiered RAM budget's overflow): the list's sums are not the engine's own (shared blocks), so an unchanged tier
    is not second-guessed."""
    out: list[Eviction] = []
    new_storage = str(changes.get("conversation_cache_storage", storage))
    used_tiers = {"ram": ("ram",), "disk": ("disk",), "tiered": ("ram", "disk")}.get(new_storage, ())
    # a disk budget of 0 leaves the disk unused: its files stay for a later return, and nothing is written there
    disk_used = "disk" in used_tiers and changes.get(BUDGETS["disk"], running.get(BUDGETS["disk"], 0)) > 0
    used_tiers = tuple(t for t in used_tiers if t != "disk" or disk_used)
    # conversations written to disk by this change: every RAM one when the storage becomes disk alone
    moving = [r for r in rows if "ram" in r.tiers] if new_storage == "disk" and storage != "disk" and disk_used else []
    for tier in used_tiers:
        key = BUDGETS[tier]
        budget_mib = changes.get(key, running.get(key, 0))
        shrinks = key in changes and changes[key] < running.get(key, 0)
        sizes = {r.id: (r, float(r.bytes_by_tier[tier])) for r in rows if tier in r.tiers}
        arriving = moving if tier == "disk" else []
        for r in arriving:  # its disk copy, if any, is superseded by what is written now
            sizes[r.id] = (r, max(sizes[r.id][1] if r.id in sizes else 0.0, float(r.bytes_by_tier["ram"])))
        if not shrinks and not arriving:
            continue
        gone = _evict(sizes, budget_mib * MIB)
        if gone:
            spilled = tier == "ram" and new_storage == "tiered" and disk_used
            out.append(Eviction(tier, len(gone), sum(size for _, size in gone), len(sizes), format_mib(budget_mib),
                                spilled=spilled))
            if spilled:  # written to disk, where the disk budget weighs them next
                moving = [r for r, _ in gone]
    if SLOTS in changes and changes[SLOTS] < running.get(SLOTS, 0) and len(rows) > changes[SLOTS]:
        extra = _eviction_order(rows)[: len(rows) - changes[SLOTS]]
        out.append(Eviction("slots", len(extra), float(sum(r.bytes for r in extra)), len(rows),
                            f"{changes[SLOTS]} conversation{'s' if changes[SLOTS] != 1 else ''}"))
    return out


def describe(evictions: list[Eviction]) -> str:
    """The question to ask before applying, in words."""
    lines = []
    for e in evictions:
        what = f"{e.count} of {e.of} parked conversation{'s' if e.of != 1 else ''} ({format_bytes(e.bytes)})"
        if e.where == "slots":
            lines.append(f"• drops {what}: at most {e.limit} are kept.")
        elif e.spilled:
            lines.append(f"• moves {what} from RAM to disk, to fit the RAM budget of {e.limit}.")
        else:
            place = "RAM" if e.where == "ram" else "disk"
            lines.append(f"• drops {what} from {place}, to fit the {place} budget of {e.limit}.")
    return ("Applying this change\n" + "\n".join(lines) + "\n\nLow priority before normal before high go first, "
            "pinned ones last, the least recently used first among those. This is an "
            "estimate from the engine's last list of conversations; dropped ones are prefilled again when they "
            "come back. " + SUMMED_BYTES)
