"""The parked-conversations table: one row per conversation the engine reports in /cache/conversations."""

from __future__ import annotations

import time
from typing import Any

from PySide6.QtCore import Qt

from desktop.monitor.lineage import final_id
from desktop.monitor.report import format_age, format_count, number, timestamp
from desktop.monitor.rows_model import Index, RowsModel
from desktop.settings import format_bytes

SORT_ROLE = Qt.ItemDataRole.UserRole + 1


def tier_label(tier: Any) -> str:
    if isinstance(tier, list | tuple):
        return " + ".join(tier_label(t) for t in tier)
    text = str(tier or "–")
    return {"ram": "RAM", "disk": "disk", "ram+disk": "RAM + disk", "both": "RAM + disk"}.get(text.lower(), text)


TIER_ORDER = {"ram": 0, "disk": 1}


def merge_tiers(rows: list[Any], links: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """One row per conversation: the engine lists a conversation once per tier that holds it (tiered mode), and
    a conversation restored from disk and parked again under a new id beside its disk copy (`links`, old id ->
    new, from `desktop.monitor.lineage`).

    The merged row carries the newest id (the one actions address) and `ids`, all of them; its tier is the list
    of tiers (RAM first); tokens the most any copy holds; bytes what all copies take together, with
    `bytes_by_tier`; created the earliest, last used the latest; hits the most any copy of one id counted (a copy
    written to disk carries the hits it had then, so adding them would count twice), added up over ids (a new id
    counts from zero); checkpoints (and their bytes) the most any copy holds.
    Rows without an id are kept as they are. The first appearance fixes the order.
    """
    links = links or {}
    groups: dict[Any, list[dict[str, Any]]] = {}
    out: list[Any] = []
    for row in rows:
        if not isinstance(row, dict):
            continue
        if row.get("id") is None:
            out.append(row)
            continue
        key = final_id(row["id"], links)
        if key not in groups:
            groups[key] = []
            out.append(key)
        groups[key].append(row)
    return [_merged(key, groups[key]) if not isinstance(key, dict) else key for key in out]


def _merged(key: Any, rows: list[dict[str, Any]]) -> dict[str, Any]:
    if len(rows) == 1:
        return rows[0]  # held by one tier under one id: the engine's row as it was
    own = next((r for r in rows if r["id"] == key), rows[0])  # the live id speaks for priority, pin, name
    have = dict(own)
    have["ids"] = list(dict.fromkeys([key, *(r["id"] for r in rows)]))
    tiers = {str(r.get("tier") or "") for r in rows} - {""}
    have["tier"] = sorted(tiers, key=lambda t: (TIER_ORDER.get(t, 9), t))
    by_tier: dict[str, float] = {}
    for r in rows:
        size = number(r, "bytes")
        if r.get("tier") and size is not None:
            by_tier[str(r["tier"])] = by_tier.get(str(r["tier"]), 0) + size
    have["bytes_by_tier"] = by_tier
    for field, pick in (("tokens", max), ("last_used", max), ("created", min), ("checkpoints", max),
                        ("checkpoint_bytes", max)):
        values = [r.get(field) for r in rows if r.get(field) is not None]
        if values and all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
            have[field] = pick(values)
    hits: dict[Any, Any] = {}
    for r in rows:
        if isinstance(r.get("hits"), int | float) and not isinstance(r.get("hits"), bool):
            hits[r["id"]] = max(hits.get(r["id"], 0), r["hits"])
    if hits:
        have["hits"] = sum(hits.values())
    have["bytes"] = sum(by_tier.values()) if by_tier else have.get("bytes")
    have["pending"] = any(bool(r.get("pending")) for r in rows)
    if len(have["tier"]) <= 1 and len(by_tier) <= 1 and len(have["ids"]) == 1:
        have["tier"] = have["tier"][0] if have["tier"] else None
        have.pop("bytes_by_tier", None)
    return have


def name_tooltip(row: dict[str, Any]) -> str:
    """What hovering a conversation's name shows: its first words, its system prompt's, and its id."""
    lines = [f"{row['name']} · {row.get('id', '')}" if row.get("name") else str(row.get("id", ""))]
    if row.get("system"):
        lines.append(f"System: {row['system']}")
    return "\n".join(lines)


def checkpoints_label(row: dict[str, Any]) -> str:
    """A hybrid conversation's checkpoints and their bytes ("3 · 1.2 MiB"); "–" for none (attention-only)."""
    n = number(row, "checkpoints")
    if not n:
        return "–"
    size = number(row, "checkpoint_bytes")
    return format_count(n) + ("" if size is None else f" · {format_bytes(size)}")


def tiers_of(row: dict[str, Any]) -> list[str]:
    """The tiers that hold a (merged) conversation row, lower case."""
    tier = row.get("tier")
    return [str(t).lower() for t in tier] if isinstance(tier, list | tuple) else [str(tier or "").lower()]


class ConversationsModel(RowsModel):
    COLUMNS = ("Conversation", "Tokens", "Size", "Tier", "Age", "Last used", "Hits", "Client", "Priority", "Pinned",
               "Checkpoints")
    TEXT_COLUMNS = (0, 3, 7, 8, 9)
    HEADER_TIPS = {"Size": "This conversation's own bytes, the blocks it shares with others included (the RAM and "
                           "Disk bars count a shared block once)."}

    def __init__(self, parent: Any = None) -> None:
        super().__init__(parent)
        self.now = time.time()
        self.links: dict[str, str] = {}  # old id -> the id it goes on under (desktop.monitor.lineage)

    def set_rows(self, rows: list[dict[str, Any]]) -> None:
        """Replace the rows; the same conversations in the same order update in place (selection survives)."""
        self.now = time.time()
        rows = merge_tiers(rows, self.links)
        if [r.get("id") for r in rows] == [r.get("id") for r in self.rows]:
            self.rows = rows
            if rows:
                self.dataChanged.emit(self.index(0, 0), self.index(len(rows) - 1, len(self.COLUMNS) - 1))
            return
        self.beginResetModel()
        self.rows = rows
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
        if role == Qt.ItemDataRole.ToolTipRole and col == 10 and number(row, "checkpoints"):
            return ("Recurrent-state checkpoints (a hybrid model): token positions this conversation can resume "
                    "from, and what they take of its size")
        if role == Qt.ItemDataRole.ToolTipRole and col == 2 and len(row.get("bytes_by_tier") or {}) > 1:
            return " · ".join(f"{tier_label(t)} {format_bytes(b)}" for t, b in row["bytes_by_tier"].items())
        return None

    def _display(self, row: dict[str, Any], col: int) -> str:
        if col == 0:  # its name (the first words of its first user message) when the engine knows it
            return str(row.get("name") or row.get("id", "–"))
        if col == 1:
            return format_count(number(row, "tokens"))
        if col == 2:
            return format_bytes(number(row, "bytes"))
        if col == 3:
            return tier_label(row.get("tier"))
        if col == 4:
            t = timestamp(row.get("created"))
            return format_age(None if t is None else self.now - t)
        if col == 5:
            t = timestamp(row.get("last_used"))
            return "–" if t is None else format_age(self.now - t) + " ago"
        if col == 6:
            return format_count(number(row, "hits"))
        if col == 7:
            return str(row.get("client") or "–")
        if col == 8:
            return str(row.get("priority") or "normal")
        if col == 9:
            return "pinned" if row.get("pinned") else ""
        return checkpoints_label(row)

    def _sort_key(self, row: dict[str, Any], col: int) -> Any:
        if col == 8:  # high first when ascending
            return {"high": 0, "normal": 1, "low": 2}.get(str(row.get("priority") or "normal"), 3)
        if col in self.TEXT_COLUMNS:
            return self._display(row, col)
        if col == 10:
            return number(row, "checkpoints") or 0
        key = ("tokens", "bytes", None, "created", "last_used", "hits")[col - 1]
        value = timestamp(row.get(key)) if col in (4, 5) else number(row, key)
        if col in (4, 5) and value is not None:
            value = -value  # older first when ascending by age
        return value if value is not None else float("-inf")
