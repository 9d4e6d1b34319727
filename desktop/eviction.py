"""What a settings change would evict, estimated before it is applied (as Purge says what it drops).

This replays the engine's eviction (engine/cache/policy.py `eviction_order`, engine/cache/reconfigure.py) on its
last list of conversations (`/cache/conversations`, merged one row per conversation), tier by tier: each tier's
budget and slot count take conversations unpinned before pinned, low before normal before high priority, least
recently used first within those, until what is left fits. A switch to disk storage writes every RAM
conversation to disk, and a tiered RAM budget writes what it pushes out; each is written on its own, making room
as a spill does. The figures are an estimate: the engine may have parks in flight and entries the list has not
shown yet, blocks two conversations share are counted in each, a conversation written to disk is counted at its
RAM size (its files add a header and alignment to each block), a folder's files are not listed while disk
storage is off (a switch to it weighs them in the engine), and with a draft model the engine gives the draft's
parked rows their share of each budget.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from desktop.monitor.conversations import ParkedConversation
from desktop.settings import SUMMED_BYTES, format_bytes, format_mib
from engine.contract import ConversationRow

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
    ids: tuple[str, ...] = field(default=(), compare=False)  # the engine's ids of the copies that go
    why: str = ""  # said instead of the budget, where no budget explains it


PRIORITY_RANK = {"low": 0, "normal": 1, "high": 2}


@dataclass(frozen=True, slots=True)
class _Copy:
    """One tier's copy of a conversation, with its own figures (a disk copy keeps the pin and last use it had)."""

    row: ConversationRow
    size: float

    @property
    def rank(self) -> int:
        return PRIORITY_RANK.get(self.row.priority, 1)


Held = dict[str, _Copy]  # a tier's copies by the engine's id


def _copies(rows: list[ParkedConversation], tier: str) -> list[tuple[ParkedConversation, _Copy]]:
    """`tier`'s copies of `rows`' conversations, each with the conversation it belongs to."""
    return [(conv, _Copy(row, float(row.bytes))) for conv in rows for row in conv.rows if row.tier == tier]


def _eviction_order(copies: list[_Copy]) -> list[_Copy]:
    """The engine's order: unpinned before pinned, low before normal before high, least recently used first."""
    return sorted(copies, key=lambda c: (c.row.pinned, c.rank, c.row.last_used))


def _room(held: Held, budget: float, slots: int, adding: _Copy | None = None) -> list[str] | None:
    """The ids `held` gives up, in the engine's order (engine/cache/policy.py `plan_room`), so that it fits `budget`
    bytes and `slots` entries with `adding` (whose room is made only from copies of its priority or below), or,
    with nothing added, as far as it can. None when `adding` cannot be made to fit."""
    total = sum(c.size for c in held.values()) + (adding.size if adding else 0.0)
    count = len(held) + (adding is not None)
    gone = []
    for copy in _eviction_order(list(held.values())):
        if total <= budget and count <= slots:
            break
        if adding is not None and copy.rank > adding.rank:
            continue
        gone.append(copy.row.id)
        total -= copy.size
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
    count, or all of it when the new settings keep nothing in RAM; then each conversation written to disk, one at
    a time, making room there as a spill does (it may push out only copies of its priority or below, and is
    dropped itself when that is not enough); then the disk tier's own budget. A tier is weighed when its budget
    or the slot count shrinks or conversations move into it: the list's sums are not the engine's own (shared
    blocks), so an unchanged tier is not second-guessed."""
    out: list[Eviction] = []
    new_storage = str(changes.get("conversation_cache_storage", storage))
    slots = int(changes.get(SLOTS, running.get(SLOTS, 0)))
    slots_shrink = SLOTS in changes and changes[SLOTS] < running.get(SLOTS, 0)

    def budget_of(tier: str) -> tuple[float, bool]:
        key = BUDGETS[tier]
        mib = changes.get(key, running.get(key, 0))
        return mib, slots_shrink or (key in changes and changes[key] < running.get(key, 0))

    # as engine/cache/settings.py `uses_ram` / `uses_disk`: a budget of 0 leaves a tier unused (a disk's files stay)
    ram_on = new_storage in ("ram", "tiered") and budget_of("ram")[0] > 0
    disk_on = new_storage in ("disk", "tiered") and budget_of("disk")[0] > 0
    ram_was_on = storage in ("ram", "tiered") and running.get(BUDGETS["ram"], 0) > 0
    in_ram = _copies(rows, "ram") if ram_was_on else []  # (a RAM row under disk storage is a park on its way)
    arriving: list[tuple[ParkedConversation, _Copy]] = []  # written to disk by this change, in the engine's order
    if not ram_on and in_ram:
        if disk_on:  # every RAM conversation is written to disk, in the RAM index's order (least recently used first)
            arriving = sorted(in_ram, key=lambda pc: pc[1].row.last_used)
        else:  # RAM storage with a RAM budget of 0 says so by its budget; the others keep nothing anywhere
            why = "" if new_storage == "ram" else ("a budget of 0 leaves its tier unused, so these settings keep "
                                                   "no conversations (files already on disk stay)")
            out.append(Eviction("ram", len(in_ram), sum(c.size for _, c in in_ram), len(in_ram),
                                _limit(budget_of("ram")[0], slots, slots_shrink),
                                ids=tuple(c.row.id for _, c in in_ram), why=why))
    elif in_ram:
        mib, shrinks = budget_of("ram")
        held = {c.row.id: c for _, c in in_ram}
        gone = (_room(held, mib * MIB, slots) or []) if shrinks else []
        if gone:
            spilled = new_storage == "tiered" and disk_on
            out.append(Eviction("ram", len(gone), sum(held[i].size for i in gone), len(held),
                                _limit(mib, slots, slots_shrink), spilled=spilled, ids=tuple(gone)))
            if spilled:  # each evicted copy is handed to the disk as it goes, in that order
                by_id = {pc[1].row.id: pc for pc in in_ram}
                arriving = [by_id[i] for i in gone]
    if disk_on:
        mib, shrinks = budget_of("disk")
        on_disk = _copies(rows, "disk")
        held = {c.row.id: c for _, c in on_disk}
        if shrinks or arriving:
            there = set(held) | {c.row.id for _, c in arriving}
            lost: list[_Copy] = []
            for conv, copy in arriving:
                # a disk copy of the same tokens means nothing is written; shorter ones are superseded (a longer
                # one is another conversation to the engine, and stays beside it)
                old = [c for other, c in on_disk if other is conv and c.row.id in held]
                if any(c.row.tokens == copy.row.tokens for c in old):
                    continue
                superseded = {c.row.id for c in old if c.row.tokens < copy.row.tokens}
                rest = {i: c for i, c in held.items() if i not in superseded}
                gone = _room(rest, mib * MIB, slots, adding=copy)
                if gone is None:
                    lost.append(copy)  # dropped: the copies it had on disk stay
                    continue
                lost += [rest.pop(i) for i in gone]
                rest[copy.row.id] = copy
                held = rest
            lost += [held.pop(i) for i in _room(held, mib * MIB, slots) or []]
            if lost:
                out.append(Eviction("disk", len(lost), sum(c.size for c in lost), len(there),
                                    _limit(mib, slots, slots_shrink), ids=tuple(c.row.id for c in lost)))
    return out


def describe(evictions: list[Eviction]) -> str:
    """The question to ask before applying, in words."""
    lines = []
    for e in evictions:
        what = f"{e.count} of {e.of} parked conversation{'s' if e.of != 1 else ''} ({format_bytes(e.bytes)})"
        if e.why:
            lines.append(f"• drops {what} from {'RAM' if e.where == 'ram' else 'disk'}: {e.why}.")
        elif e.spilled:
            lines.append(f"• moves {what} from RAM to disk, to fit the RAM budget of {e.limit}.")
        else:
            place = "RAM" if e.where == "ram" else "disk"
            lines.append(f"• drops {what} from {place}, to fit the {place} budget of {e.limit}.")
    return ("Applying this change\n" + "\n".join(lines) + "\n\nLow priority before normal before high go first, "
            "pinned ones last, the least recently used first among those. This is an "
            "estimate from the engine's last list of conversations; dropped ones are prefilled again when they "
            "come back. " + SUMMED_BYTES)
