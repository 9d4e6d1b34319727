"""A read-only table of typed rows under fixed column titles: what the Monitor's tables share."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from PySide6.QtCore import QAbstractTableModel, QModelIndex, QPersistentModelIndex, Qt

Index = QModelIndex | QPersistentModelIndex
R = TypeVar("R")  # a row: a parked conversation, a request record


class RowsModel(QAbstractTableModel, Generic[R]):
    """`rows` (one object each: a parked conversation, a request record) under `COLUMNS`; a subclass says how a
    row reads (`data`) and how rows arrive."""

    COLUMNS: tuple[str, ...] = ()
    HEADER_TIPS: dict[str, str] = {}  # a column's header tooltip, where its figures need a word

    def __init__(self, parent: Any = None) -> None:
        super().__init__(parent)
        self.rows: list[R] = []

    def rowCount(self, parent: Index = QModelIndex()) -> int:  # noqa: B008
        return 0 if parent.isValid() else len(self.rows)

    def columnCount(self, parent: Index = QModelIndex()) -> int:  # noqa: B008
        return 0 if parent.isValid() else len(self.COLUMNS)

    def headerData(self, section: int, orientation: Qt.Orientation, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if orientation == Qt.Orientation.Horizontal and role == Qt.ItemDataRole.DisplayRole:
            return self.COLUMNS[section]
        if orientation == Qt.Orientation.Horizontal and role == Qt.ItemDataRole.ToolTipRole:
            return self.HEADER_TIPS.get(self.COLUMNS[section])
        return None

    def row_at(self, index: Index) -> R | None:
        """The row an index points into, or None for an invalid index or one past the rows."""
        if not index.isValid() or index.row() >= len(self.rows):
            return None
        return self.rows[index.row()]
