"""The parked-conversations table: one row per conversation the engine reports in /cache/conversations (its
rows, typed by engine.contract, merged across tiers and ids)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from PySide6.QtCore import Qt

from desktop.monitor.lineage import final_id
from desktop.monitor.report import format_age, format_count
from desktop.monitor.rows_model import Index, RowsModel
from desktop.settings import format_bytes
from engine.contract import ConversationRow

SORT_ROLE = Qt.ItemDataRole.UserRole + 1


def tier_label(tiers: tuple[str, ...]) -> str:
    """("ram", "disk") -> "RAM + disk"; "–" for none."""
    return " + ".join({"ram": "RAM", "disk": "disk"}.get(t.lower(), t or "–") for t in tiers) or "–"


TIER_ORDER = {"ram": 0, "disk": 1}


@dataclass(frozen=True, slots=True)
class ParkedConversation:
    """One parked conversation as the Monitor lists it: the engine's rows of it merged into one.

    The engine lists a conversation once per tier that holds it (tiered mode), and a conversation restored from
    disk and parked again under a new id beside its disk copy (`merge_tiers`' links). `row` is the newest id's
    row (it speaks for name, system words, client, priority and pin; actions address its id); `ids` all of them,
    the newest first; `tiers` the tiers holding it, RAM first; `tokens` the most any copy holds; `bytes` what all
    copies take together, by tier in `bytes_by_tier`; created the earliest, last used the latest; `hits` the most
    any copy of one id counted (a copy written to disk carries the hits it had then, so adding them would count
    twice), added up over ids (a new id counts from zero); checkpoints (and their bytes) the most any copy holds.
    A conversation held once is its row's figures as they are. `rows` are the engine's rows as listed (the
    eviction estimate weighs each copy by its own figures).
    """

    row: ConversationRow
    ids: tuple[str, ...]
    tiers: tuple[str, ...]
    tokens: int
    bytes: int
    bytes_by_tier: dict[str, int]
    created: float
    last_used: float
    hits: int
    pending: bool
    checkpoints: int
    checkpoint_bytes: int
    rows: tuple[ConversationRow, ...]

    @property
    def id(self) -> str:
        return self.row.id

    @property
    def name(self) -> str:
        return self.row.name

    @property
    def system(self) -> str:
        return self.row.system

    @property
    def client(self) -> str:
        return self.row.client

    @property
    def priority(self) -> str:
        return self.row.priority

    @property
    def pinned(self) -> bool:
        return self.row.pinned

    @classmethod
    def of(cls, rows: list[ConversationRow], key: str) -> ParkedConversation:
        """The rows of one conversation (at least one) merged; `key` is the id it goes on under."""
        own = next((r for r in rows if r.id == key), rows[0])
        by_tier: dict[str, int] = {}
        hits: dict[str, int] = {}
        for r in rows:
            by_tier[r.tier] = by_tier.get(r.tier, 0) + r.bytes
            hits[r.id] = max(hits.get(r.id, 0), r.hits)
        return cls(row=own, ids=tuple(dict.fromkeys([own.id, *(r.id for r in rows)])),
                   tiers=tuple(sorted(by_tier, key=lambda t: (TIER_ORDER.get(t, 9), t))),
                   tokens=max(r.tokens for r in rows), bytes=sum(by_tier.values()), bytes_by_tier=by_tier,
                   created=min(r.created for r in rows), last_used=max(r.last_used for r in rows),
                   hits=sum(hits.values()), pending=any(r.pending for r in rows),
                   checkpoints=max(r.checkpoints for r in rows),
                   checkpoint_bytes=max(r.checkpoint_bytes for r in rows), rows=tuple(rows))


def merge_tiers(rows: list[ConversationRow], links: dict[str, str] | None = None) -> list[ParkedConversation]:
    """One entry per conversation from the engine's rows (one per tier and id; `links`, old id -> new, from
    `desktop.monitor.lineage`, ties a restored conversation's new id to its disk copy's). The first appearance
    fixes the order."""
    links = links or {}
    groups: dict[str, list[ConversationRow]] = {}
    for row in rows:
        groups.setdefault(final_id(row.id, links), []).append(row)
    return [ParkedConversation.of(group, key) for key, group in groups.items()]


def name_tooltip(row: ParkedConversation) -> str:
    """What hovering a conversation's name shows: its first words, its system prompt's, and its id."""
    lines = [f"{row.name} · {row.id}" if row.name else row.id]
    if row.system:
        lines.append(f"System: {row.system}")
    return "\n".join(lines)


def checkpoints_label(row: ParkedConversation) -> str:
    """A hybrid conversation's checkpoints and their bytes ("3 · 1.2 MiB"); "–" for none (attention-only)."""
    if not row.checkpoints:
        return "–"
    return f"{format_count(row.checkpoints)} · {format_bytes(row.checkpoint_bytes)}"


class ConversationsModel(RowsModel[ParkedConversation]):
    COLUMNS = ("Conversation", "Tokens", "Size", "Tier", "Age", "Last used", "Hits", "Client", "Priority", "Pinned",
               "Checkpoints")
    TEXT_COLUMNS = (0, 3, 7, 8, 9)
    HEADER_TIPS = {"Size": "This conversation's own bytes, the blocks it shares with others included (the RAM and "
                           "Disk bars count a shared block once)."}

    def __init__(self, parent: Any = None) -> None:
        super().__init__(parent)
        self.now = time.time()
        self.links: dict[str, str] = {}  # old id -> the id it goes on under (desktop.monitor.lineage)

    def set_rows(self, rows: list[ConversationRow]) -> None:
        """Replace the rows; the same conversations in the same order update in place (selection survives)."""
        self.now = time.time()
        merged = merge_tiers(rows, self.links)
        if [r.id for r in merged] == [r.id for r in self.rows]:
            self.rows = merged
            if merged:
                self.dataChanged.emit(self.index(0, 0), self.index(len(merged) - 1, len(self.COLUMNS) - 1))
            return
        self.beginResetModel()
        self.rows = merged
        self.endResetModel()

    def data(self, index: Index, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        row, col = self.row_at(index), index.column()
        if row is None:
            return None
        if role == Qt.ItemDataRole.DisplayRole:
            return self._display(row, col)
        if role == SORT_ROLE:
            return self._sort_key(row, col)
        if role == Qt.ItemDataRole.TextAlignmentRole and col in (1, 2, 4, 5, 6, 10):
            return int(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        if role == Qt.ItemDataRole.ToolTipRole and col == 0:
            return name_tooltip(row)
        if role == Qt.ItemDataRole.ToolTipRole and col == 10 and row.checkpoints:
            return ("Recurrent-state checkpoints (a hybrid model): token positions this conversation can resume "
                    "from, and what they take of its size")
        if role == Qt.ItemDataRole.ToolTipRole and col == 2 and len(row.bytes_by_tier) > 1:
            return " · ".join(f"{tier_label((t,))} {format_bytes(b)}" for t, b in row.bytes_by_tier.items())
        return None

    def _display(self, row: ParkedConversation, col: int) -> str:
        if col == 0:  # its name (the first words of its first user message) when the engine knows it
            return row.name or row.id
        if col == 1:
            return format_count(row.tokens)
        if col == 2:
            return format_bytes(row.bytes)
        if col == 3:
            return tier_label(row.tiers)
        if col == 4:
            return format_age(self.now - row.created)
        if col == 5:
            return format_age(self.now - row.last_used) + " ago"
        if col == 6:
            return format_count(row.hits)
        if col == 7:
            return row.client or "–"
        if col == 8:
            return row.priority
        if col == 9:
            return "pinned" if row.pinned else ""
        return checkpoints_label(row)

    def _sort_key(self, row: ParkedConversation, col: int) -> Any:
        if col == 8:  # high first when ascending
            return {"high": 0, "normal": 1, "low": 2}.get(row.priority, 3)
        if col in self.TEXT_COLUMNS:
            return self._display(row, col)
        if col in (4, 5):  # older first when ascending by age
            return -(row.created if col == 4 else row.last_used)
        return (row.tokens, row.bytes, None, None, None, row.hits, None, None, None, row.checkpoints)[col - 1]
