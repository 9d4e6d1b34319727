"""The request log: every completion the engine explained (GET /cache/requests), newest first, and one
conversation's reuse history (the log's requests of that conversation, with a summary).

Each row answers "why was this slow?": how much of the prompt was reused, from where, and why the rest was
computed, in words (the reason's detail is the tooltip), with the time to first token.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QAbstractItemView,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QPushButton,
    QTableView,
    QVBoxLayout,
    QWidget,
)

from desktop.monitor.report import format_age, format_count, format_drafts, format_ms, number
from desktop.monitor.rows_model import Index, RowsModel
from engine.contract import RequestRecord

SOURCES = {"live": "live slot", "ram": "RAM", "disk": "disk", "remote": "remote store", "checkpoint": "checkpoint",
           "none": "–"}


def _pct(part: float | None, whole: float | None) -> str:
    return f"{100 * part / whole:.0f}%" if part is not None and whole else "–"


def reason_text(record: RequestRecord, now: float | None = None) -> str:
    """The reason in a few words: what made the engine compute the tokens it did not reuse. Its `detail` is the
    one open object of the contract (its keys depend on the reason): read by name, a missing key shows as "–"."""
    reason, d = record.reason, record.detail
    if reason == "new_tokens":
        return f"new tokens only ({format_count(number(d, 'computed'))})"
    if reason == "diverged":
        return f"diverged at token {format_count(number(d, 'diverged_at'))}"
    if reason == "template":
        return (f"the chat template rewrote the history from token {format_count(number(d, 'rewritten_at'))} "
                f"(diverged at {format_count(number(d, 'diverged_at'))})")
    if reason == "evicted":
        when = number(d, "when")
        ago = "" if when is None else f" {format_age((now or time.time()) - when)} ago"
        kind = {"evict": "evicted", "purge": "purged", "expire": "expired"}.get(str(d.get("kind")), "dropped")
        budget = f" (--{d['budget']})" if d.get("budget") else ""
        by = f" by {d['by']}" if d.get("by") and kind == "evicted" else ""
        return f"{kind}{ago}{by}{budget}"
    if reason == "floor":
        return "its park was refused by the free-memory floor"
    if reason == "refused":
        return f"its park was refused ({d.get('refusal', '?')})"
    if reason == "n_min":
        return f"hit of {format_count(number(d, 'offered'))} tokens < n-min {format_count(number(d, 'n_min'))}"
    if reason == "similarity":
        share = _pct(number(d, "offered"), record.prompt_tokens)
        return f"hit covers {share} < similarity {number(d, 'similarity') or 0:.0%}"
    if reason == "cost":
        restore, prefill = number(d, "predicted_restore_s"), number(d, "predicted_prefill_s")
        if restore is None or prefill is None:
            return "not worth restoring (cost model)"
        return f"restore {format_ms(restore * 1000)} ≥ prefill {format_ms(prefill * 1000)}"
    if reason == "window":
        return f"left the parked window ({format_count(number(d, 'shared'))} tokens shared, before its last window)"
    return {"small_gain": "hit saved too little over the live slot", "restore_failed": "restore failed",
            "cold": "nothing shared (new conversation)"}.get(reason, reason or "–")


def reason_tooltip(record: RequestRecord) -> str:
    """The reason's whole detail: the text either side of a divergence, what evicted it, the two predictions."""
    d = record.detail
    lines = [reason_text(record)]
    if record.reason in ("diverged", "template"):
        lines += [f"compared with {d.get('candidate', '?')} ({format_count(number(d, 'candidate_tokens'))} tokens)",
                  f"prompt:    …{d.get('before', '')}⟦{d.get('prompt_after', '')}⟧",
                  f"candidate: …{d.get('before', '')}⟦{d.get('candidate_after', '')}⟧"]
    elif record.reason == "evicted" and d.get("by_conversation"):
        lines.append(f"to make room for conversation {d['by_conversation']}")
    for key, value in d.items():
        if key not in ("before", "prompt_after", "candidate_after"):
            lines.append(f"{key}: {value}")
    return "\n".join(lines)


def conversation_label(record: RequestRecord) -> str:
    return record.name or record.conversation_id or "–"


def history_summary(records: list[RequestRecord]) -> str:
    """One conversation's requests in a line: how many, the share of prompt tokens reused, the TTFTs, and the
    draft tokens accepted where speculative decoding drafted any."""
    if not records:
        return "No request of this conversation in the log yet."
    prompt = sum(r.prompt_tokens for r in records)
    reused = sum(r.reused_tokens for r in records)
    ttfts = [r.ttft_ms for r in records if r.ttft_ms is not None]
    ttft = f"TTFT median {format_ms(statistics.median(ttfts))}, last {format_ms(ttfts[-1])}" if ttfts else "TTFT –"
    n = len(records)
    text = f"{n} request{'s' if n != 1 else ''} · reused {_pct(reused, prompt)} of their prompt tokens · {ttft}"
    drafted = sum(r.spec_drafted for r in records)
    if drafted:  # --spec: the conversation's draft tokens over its finished requests
        text += " · drafts: " + format_drafts(drafted, sum(r.spec_accepted for r in records))
    return text


class RequestsModel(RowsModel[RequestRecord]):
    COLUMNS = ("Time", "Conversation", "Prompt", "Reused", "Source", "Reason", "TTFT", "Drafts")

    def set_rows(self, rows: list[RequestRecord]) -> None:
        """The engine's records (oldest first), shown newest first."""
        self.beginResetModel()
        self.rows = list(reversed(rows))
        self.endResetModel()

    def data(self, index: Index, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        row, col = self.row_at(index), index.column()
        if row is None:
            return None
        if role == Qt.ItemDataRole.DisplayRole:
            return self._display(row, col)
        if role == Qt.ItemDataRole.ToolTipRole and col == 5:
            return reason_tooltip(row)
        if role == Qt.ItemDataRole.ToolTipRole and col == 1:
            return f"{row.conversation_id or 'not parked yet'} · {row.client or 'unknown client'}"
        if role == Qt.ItemDataRole.ToolTipRole and col == 7:
            return "Draft tokens (--spec) verified for this request and those the model kept"
        if role == Qt.ItemDataRole.TextAlignmentRole and col in (2, 3, 6):
            return int(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        return None

    def _display(self, row: RequestRecord, col: int) -> str:
        if col == 0:
            return time.strftime("%H:%M:%S", time.localtime(row.time))
        if col == 1:
            return conversation_label(row)
        if col == 2:
            return format_count(row.prompt_tokens)
        if col == 3:
            return f"{format_count(row.reused_tokens)} ({_pct(row.reused_tokens, row.prompt_tokens)})"
        if col == 4:
            return SOURCES.get(row.source, row.source)
        if col == 5:
            return reason_text(row)
        if col == 6:
            return format_ms(row.ttft_ms)
        return format_drafts(row.spec_drafted, row.spec_accepted)


class RequestLogPanel(QWidget):
    """The log's table, all requests or one conversation's (its reuse history), with a title saying which."""

    show_all_requested = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.records: list[RequestRecord] = []
        self.conversation: str | None = None  # the conversation whose history is shown; None = every request
        self.conversation_name = ""
        self.title = QLabel("<b>Requests</b>")
        self.summary = QLabel()
        self.summary.setWordWrap(True)
        self.summary.hide()
        self.show_all = QPushButton("Show all requests")
        self.show_all.hide()
        self.show_all.clicked.connect(lambda: (self.set_conversation(None), self.show_all_requested.emit()))
        self.model = RequestsModel(self)
        self.table = QTableView()
        self.table.setModel(self.model)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.verticalHeader().setVisible(False)
        self.table.setAlternatingRowColors(True)
        self.table.setMinimumHeight(130)
        header = self.table.horizontalHeader()
        for col in range(len(RequestsModel.COLUMNS)):
            mode = QHeaderView.ResizeMode.Stretch if col == 5 else QHeaderView.ResizeMode.ResizeToContents
            header.setSectionResizeMode(col, mode)
        head = QHBoxLayout()
        head.addWidget(self.title)
        head.addStretch(1)
        head.addWidget(self.show_all)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(head)
        layout.addWidget(self.summary)
        layout.addWidget(self.table)

    def set_records(self, records: list[RequestRecord]) -> None:
        self.records = records
        self._refresh()

    def set_conversation(self, conversation_id: str | None, name: str = "") -> None:
        """Show one conversation's requests (its reuse history), or every request (None)."""
        self.conversation, self.conversation_name = conversation_id, name
        self._refresh()

    def set_error(self, message: str) -> None:
        text = message.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        self.title.setText(f"<b>Requests</b> — the engine did not give its request log: {text}")

    def _refresh(self) -> None:
        if self.conversation is None:
            shown = self.records
            self.title.setText(f"<b>Requests</b> ({len(shown)}, newest first)")
        else:
            shown = [r for r in self.records if r.conversation_id == self.conversation]
            label = self.conversation_name or self.conversation
            self.title.setText(f"<b>Requests of {label.replace('<', '&lt;')}</b> ({len(shown)})")
            self.summary.setText(history_summary(shown))
        self.summary.setVisible(self.conversation is not None)
        self.show_all.setVisible(self.conversation is not None)
        self.model.set_rows(shown)
