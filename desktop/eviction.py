"""What a smaller cache budget would evict, estimated before it is applied (as Purge says what it drops).

The engine evicts least recently used conversations first until what is left fits. This replays that on the
engine's last list of conversations (`/cache/conversations`, merged one row per conversation), so the figures
are an estimate: the engine may also have parks in flight or entries the list has not shown yet.
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


def _by_recency(rows: list[ParkedConversation]) -> list[ParkedConversation]:
    return sorted(rows, key=lambda r: r.last_used, reverse=True)


def estimate(rows: list[ParkedConversation], storage: str, running: dict[str, Any],
             changes: dict[str, Any]) -> list[Eviction]:
    """What applying `changes` (field -> new value) to an engine running `running` would evict from `rows`."""
    out: list[Eviction] = []
    storage = str(changes.get("conversation_cache_storage", storage))
    used_tiers = {"ram": ("ram",), "disk": ("disk",), "tiered": ("ram", "disk")}.get(storage, ())
    for tier in used_tiers:
        key = BUDGETS[tier]
        if key not in changes or changes[key] >= running.get(key, 0):
            continue
        budget = changes[key] * MIB
        held = _by_recency([r for r in rows if tier in r.tiers])
        kept, gone, gone_bytes = 0.0, 0, 0.0
        for row in held:
            size = row.bytes_by_tier[tier]
            if kept + size <= budget:
                kept += size  # most recent first: these stay
            else:
                gone += 1
                gone_bytes += size
        if gone:
            out.append(Eviction(tier, gone, gone_bytes, len(held), format_mib(changes[key]),
                                spilled=tier == "ram" and storage == "tiered"))
    if SLOTS in changes and changes[SLOTS] < running.get(SLOTS, 0) and len(rows) > changes[SLOTS]:
        extra = _by_recency(rows)[changes[SLOTS]:]
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
    return ("Applying this change\n" + "\n".join(lines) + "\n\nThe least recently used go first. This is an "
            "estimate from the engine's last list of conversations; dropped ones are prefilled again when they "
            "come back. " + SUMMED_BYTES)
