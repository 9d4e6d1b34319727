"""The parked-conversations table: one row per conversation the engine reports in /cache/conversations."""

from __future__ import annotations

import time
from typing import Any

from PySide6.QtCore import QAbstractTableModel, QModelIndex, QPersistentModelIndex, Qt

from desktop.monitor.report import format_age, format_count, number, timestamp
from desktop.settings import format_bytes

SORT_ROLE = Qt.ItemDataRole.UserRole + 1
Index = QModelIndex | QPersistentModelIndex


def tier_label(tier: Any) -> str:
    if isinstance(tier, list | tuple):
        return " + ".join(tier_label(t) for t in tier)
    text = str(tier or "–")
    return {"ram": "RAM", "disk": "disk", "ram+disk": "RAM + disk", "both": "RAM + disk"}.get(text.lower(), text)


class ConversationsModel(QAbstractTableModel):
    COLUMNS = ("Conversation", "Tokens", "Size", "Tier", "Age", "Last used", "Hits")

    def __init__(self, parent: Any = None) -> None:
        super().__init__(parent)
        self.rows: list[dict[str, Any]] = []
        self.now = time.time()

    def set_rows(self, rows: list[dict[str, Any]]) -> None:
        """Replace the rows; the same conversations in the same order update in place (selection survives)."""
        self.now = time.time()
        rows = [r for r in rows if isinstance(r, dict)]
        if [r.get("id") for r in rows] == [r.get("id") for r in self.rows]:
            self.rows = rows
            if rows:
                self.dataChanged.emit(self.index(0, 0), self.index(len(rows) - 1, len(self.COLUMNS) - 1))
            return
        self.beginResetModel()
        self.rows = rows
        self.endResetModel()

    def rowCount(self, parent: Index = QModelIndex()) -> int:  # noqa: B008
        return 0 if parent.isValid() else len(self.rows)

    def columnCount(self, parent: Index = QModelIndex()) -> int:  # noqa: B008
        return 0 if parent.isValid() else len(self.COLUMNS)

    def headerData(self, section: int, orientation: Qt.Orientation, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if orientation == Qt.Orientation.Horizontal and role == Qt.ItemDataRole.DisplayRole:
            return self.COLUMNS[section]
        return None

    def data(self, index: Index, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if not index.isValid() or index.row() >= len(self.rows):
            return None
        row, col = self.rows[index.row()], index.column()
        if role == Qt.ItemDataRole.DisplayRole:
            return self._display(row, col)
        if role == SORT_ROLE:
            return self._sort_key(row, col)
        if role == Qt.ItemDataRole.TextAlignmentRole and col in (1, 2, 4, 5, 6):
            return int(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        if role == Qt.ItemDataRole.ToolTipRole and col == 0:
            return str(row.get("id", ""))
        return None

    def _display(self, row: dict[str, Any], col: int) -> str:
        if col == 0:
            return str(row.get("id", "–"))
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
        return format_count(number(row, "hits"))

    def _sort_key(self, row: dict[str, Any], col: int) -> Any:
        if col in (0, 3):
            return self._display(row, col)
        key = ("tokens", "bytes", None, "created", "last_used", "hits")[col - 1]
        value = timestamp(row.get(key)) if col in (4, 5) else number(row, key)
        if col in (4, 5) and value is not None:
            value = -value  # older first when ascending by age
        return value if value is not None else float("-inf")
