"""Purge from the Monitor or the tray: say what goes (count and size, from the engine's last report), ask, send
`POST /cache/purge`, and show what the engine says it dropped and skipped."""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import QObject
from PySide6.QtWidgets import QMessageBox, QWidget

from desktop.cache_actions import Snapshot, ask, live_slots_note, purge_outcome, purge_question, purge_summary
from desktop.client import EngineClient, Reply
from desktop.settings import format_bytes
from engine.contract import ContractError, PurgeBody, parse


class PurgeFlow(QObject):
    """`box` is the question while it is open; `last` the engine's last purge answer."""

    def __init__(self, window: QWidget, client: EngineClient, snapshot: Snapshot, polled: Callable[[], None],
                 status: Callable[[str, int], None]) -> None:
        super().__init__(window)
        self.window, self.client, self.snapshot, self.polled, self.status = window, client, snapshot, polled, status
        self.box: QMessageBox | None = None
        self.last: PurgeBody | None = None

    def summary(self, tier: str) -> tuple[int, int | None]:
        """(conversations, bytes) that purging `tier` drops, as last reported by the engine."""
        conversations, metrics = self.snapshot()
        return purge_summary(conversations, metrics, tier)

    def request(self, tier: str) -> None:
        """Ask for confirmation, naming what goes, then purge."""
        count, size = self.summary(tier)
        question = purge_question(count, size, tier, self.snapshot()[1])
        self.box = ask(self.window, "Purge the conversation cache", question, "Purge",
                       lambda result: self._confirmed(tier, result))

    def _confirmed(self, tier: str, result: int) -> None:
        self.box = None
        if result == QMessageBox.StandardButton.Yes:
            self.purge(tier)

    def purge(self, tier: str) -> None:
        def done(reply: Reply) -> None:
            if not reply.ok:
                self.status(f"Purge failed: {reply.error}", 15000)
                return
            try:
                body = parse(PurgeBody, reply.data, "POST /cache/purge")
            except ContractError as exc:
                self.status(f"Purge: the engine's answer is not understood: {exc}", 15000)
                return
            self.last = body
            count, size, skipped = purge_outcome(body)
            text = f"Purged {tier}: dropped {count} conversation(s), {format_bytes(size)}"
            if skipped:
                text += f"; skipped {len(skipped)} (" + "; ".join(skipped[:3]) + ")"
            text += "." + (f" {live_slots_note(self.snapshot()[1])}" if tier == "all" else "")
            self.status(text, 15000)
            self.polled()

        self.client.request("POST", "/cache/purge", done, json={"tier": tier}, timeout=30.0)
