"""Purge, budget and conversation changes: what they drop, the question asked first, and what the engine says
it did."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from PySide6.QtWidgets import QMessageBox, QWidget

from desktop.client import Reply, change_failure
from desktop.monitor.conversation_controls import conversation_title
from desktop.monitor.conversations import ParkedConversation
from desktop.settings import format_bytes
from engine.contract import ContractError, ConversationsBody, MetricsBody, PurgeBody, parse

if TYPE_CHECKING:
    from desktop.client import EngineClient
    from desktop.monitor import MonitorTab

# What the engine last reported: (conversations merged one row each, metrics); purge and eviction read it.
Snapshot = Callable[[], "tuple[list[ParkedConversation], MetricsBody | None]"]


def ask(parent: QWidget, title: str, text: str, yes_text: str, answered: Callable[[int], None]) -> QMessageBox:
    """A window-modal question with Cancel as the default; `answered` gets the button (Yes or Cancel)."""
    box = QMessageBox(QMessageBox.Icon.Warning, title, text,
                      QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.Cancel, parent)
    box.button(QMessageBox.StandardButton.Yes).setText(yes_text)
    box.setDefaultButton(QMessageBox.StandardButton.Cancel)
    box.finished.connect(answered)
    box.open()
    return box


def purge_summary(rows: list[ParkedConversation], metrics: MetricsBody | None, tier: str) -> tuple[int, int | None]:
    """(conversations, bytes) that purging `tier` drops: the listed rows (one per conversation) and the counters
    (no bytes before the first /metrics answer)."""
    count = len(rows) if tier == "all" else sum(1 for r in rows if tier in r.tiers)
    if metrics is None:
        return count, None
    cache = metrics.conversation_cache
    return count, {"ram": cache.bytes_ram, "disk": cache.bytes_disk, "all": cache.bytes_ram + cache.bytes_disk}[tier]


def live_slots_note(metrics: MetricsBody | None) -> str:
    """What a purge leaves: the conversations in the engine's slots are not parked, so no purge reaches them.

    Said for "Purge everything", whose name promises more than it can do."""
    slots = (metrics.engine.slots if metrics is not None else 0) or 1
    if slots == 1:
        return "The conversation in the engine's slot now is not parked and stays until it is switched out."
    return (f"The conversations in the engine's {slots} slots now are not parked and stay until they are "
            "switched out.")


def purge_question(count: int, size: float | None, tier: str, metrics: MetricsBody | None = None) -> str:
    where = {"ram": "from RAM", "disk": "from disk", "all": "from RAM and disk"}[tier]
    text = (f"Drop {count} parked conversation{'s' if count != 1 else ''} ({format_bytes(size)}) {where}?\n\n"
            "They will be prefilled again when they come back.")
    return text + (f"\n\n{live_slots_note(metrics)}" if tier == "all" else "")


def purge_outcome(body: PurgeBody) -> tuple[int, int, list[str]]:
    """(conversations dropped, bytes dropped, "id: reason" of each skipped) from a /cache/purge answer."""
    return body.dropped.conversations, body.dropped.bytes, [f"{s.id}: {s.reason}" for s in body.skipped]


def listed(monitor: MonitorTab, conversation_id: str) -> ParkedConversation | None:
    """The Monitor's row of a conversation, by its (newest) id."""
    return next((r for r in monitor.model.rows if r.id == conversation_id), None)


def older_ids(row: ParkedConversation | None) -> tuple[str, ...]:
    """The other ids a listed conversation has: a restored conversation parked again beside its disk copy."""
    return () if row is None else row.ids[1:]


def change_conversation(client: EngineClient, monitor: MonitorTab, conversation_id: str, changes: dict[str, Any],
                        poll: Callable[[], None]) -> None:
    """PATCH a parked conversation's priority or pin; the controls show what the engine now has, or why not."""
    row = listed(monitor, conversation_id)
    name = conversation_id if row is None else conversation_title(row)

    def done(reply: Reply) -> None:
        controls = monitor.controls
        if not reply.ok:
            controls.show_result(change_failure(name, reply), error=True)
            return
        try:
            body = parse(ConversationsBody, reply.data, "PATCH /cache/conversations/{id}")
        except ContractError as exc:
            controls.show_result(f"The engine's answer is not understood: {exc}", error=True)
            return
        now = next((r for r in body.conversations if r.id == conversation_id), None)
        if now is None:
            controls.show_result(f"The engine's answer does not list {name}.", error=True)
        else:
            controls.show_result(f"{name}: {now.priority} priority, {'pinned' if now.pinned else 'not pinned'}.",
                                 error=False)
        poll()

    client.change_conversation(conversation_id, changes, done)
    for other in older_ids(row):  # its older copy under another id keeps the same priority and pin
        client.change_conversation(other, changes)


def drop_conversation(parent: QWidget, client: EngineClient, monitor: MonitorTab, conversation_id: str,
                      poll: Callable[[], None]) -> QMessageBox:
    """Ask, then DELETE one parked conversation; the controls show what the engine dropped, or why not."""
    row = listed(monitor, conversation_id)
    name = conversation_id if row is None else conversation_title(row)
    size = "" if row is None else f" ({format_bytes(row.bytes)})"

    def done(reply: Reply) -> None:
        controls = monitor.controls
        if not reply.ok:
            said = reply.error or f"HTTP {reply.status}"
            controls.show_result(f"{name} is no longer parked. The engine said: {said}" if reply.status == 404
                                 else f"Could not drop {name}: {said}", error=True)
            return
        try:
            body = parse(PurgeBody, reply.data, "DELETE /cache/conversations/{id}")
        except ContractError as exc:
            controls.show_result(f"The engine's answer is not understood: {exc}", error=True)
            return
        if body.skipped:
            controls.show_result(f"{name} stays on disk: {body.skipped[0].reason}.", error=True)
        else:
            controls.show_result(f"Dropped {name} ({format_bytes(body.dropped.bytes)}).", error=False)
        poll()

    def answered(button: int) -> None:
        if button == QMessageBox.StandardButton.Yes:
            for other in older_ids(row):  # its older copy too, or it comes back as a row of its own
                client.drop_conversation(other)
            client.drop_conversation(conversation_id, done)

    return ask(parent, "Drop conversation", f"Drop {name}{size} from the conversation cache? Its next turn is "
               "computed from the start.", "Drop", answered)
