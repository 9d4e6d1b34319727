"""Live settings reach the running engine: `PUT /cache/config` with the changed live settings, the eviction
question first when a smaller budget would drop parked conversations, and the engine's answer shown.

The Settings tab asks for an apply by itself once a live setting's edit settles and is valid (no Apply click);
this object sends it, says what the engine now runs with (its answer, not what was sent: it may normalise a
value) and hands the outcome back to the tab (`SettingsTab.show_result`), which may then send what was edited
meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from PySide6.QtCore import QObject
from PySide6.QtWidgets import QMessageBox, QWidget

from desktop import eviction
from desktop.cache_actions import Snapshot, ask
from desktop.client import EngineClient, Reply
from desktop.engine_process import EngineProcess, EngineState
from desktop.settings_tab import SettingsTab
from desktop.settings_words import label_of
from engine.contract import CacheConfigBody, ContractError, parse

# The engine writes conversations a change moves to disk before it answers, for up to 600 s
# (engine/cache/reconfigure.py): a shorter wait would call a slow but applied change refused.
PUT_TIMEOUT_S = 630.0


class LiveApply(QObject):
    """Sends the Settings tab's live changes to the engine; `box` is the eviction question while it is open."""

    def __init__(self, window: QWidget, client: EngineClient, engine: EngineProcess, tab: SettingsTab,
                 snapshot: Snapshot, polled: Callable[[], None], status: Callable[[str, int], None]) -> None:
        super().__init__(window)
        self.window, self.client, self.engine, self.tab = window, client, engine, tab
        self.snapshot, self.polled, self.status = snapshot, polled, status
        self.box: QMessageBox | None = None
        self._sends = 0  # PUTs sent: a GET asked before one answered tells of the settings before it
        self._sending = False  # a PUT not answered yet
        self._following = False  # a GET of follow() not answered yet

    def apply(self, changes: dict[str, Any]) -> None:
        """Send live-changeable settings to the running engine; first ask if a smaller budget would evict."""
        running = self.engine.config
        conversations, metrics = self.snapshot()
        reported = "" if metrics is None else metrics.conversation_cache.storage
        storage = reported or (running.conversation_cache_storage if running else "ram")
        # every budget, not only those changed: a storage switch weighs the disk budget it leaves as it is
        names = {*changes, *eviction.BUDGETS.values(), eviction.SLOTS}
        current = {k: getattr(running, k) for k in names if running is not None and hasattr(running, k)}
        evictions = eviction.estimate(conversations, storage, current, changes)
        if not evictions:
            self._send(changes)
            return
        self.box = ask(self.window, "Apply a smaller budget", eviction.describe(evictions), "Apply",
                       lambda result: self._evicting_apply_answered(changes, result))

    def _evicting_apply_answered(self, changes: dict[str, Any], result: int) -> None:
        self.box = None
        if result == QMessageBox.StandardButton.Yes:
            self._send(changes)
        else:
            self.tab.put_back(list(changes))
            kept = ", ".join(f"{label_of(k)} = {getattr(self.engine.config, k)}" for k in changes
                             if self.engine.config is not None)
            self.tab.show_result(f"Not applied: kept {kept}; nothing was dropped.", True)

    def _send(self, changes: dict[str, Any]) -> None:
        sent = dict(changes)
        self._sends += 1
        self._sending = True

        def done(reply: Reply) -> None:
            self._sending = False
            if not reply.ok:
                self.tab.show_result(f"The engine refused the change: {reply.error}", False)
                return
            try:
                body = parse(CacheConfigBody, reply.data, "PUT /cache/config")
            except ContractError as exc:
                self.tab.show_result(f"The engine's answer is not understood: {exc}", False)
                return
            # What the engine now runs with, from its answer (not what was sent: it may have normalised it).
            now = {k: body.settings[k] for k in sent if k in body.settings}
            if self.engine.config is not None:
                self.engine.config = self.engine.config.replace(**body.settings)
                self.tab.set_engine(self.engine.state, self.engine.config)
            self.tab.set_effective_dir(body.effective_dir)
            names = ", ".join(f"{label_of(k)} = {v}" for k, v in now.items())
            self.tab.show_result(f"Applied to the running engine: {names}.", True)
            self.polled()

        # a change that moves conversations to disk answers once they are written (engine/cache/reconfigure.py)
        self.client.request("PUT", "/cache/config", done, json=sent, timeout=PUT_TIMEOUT_S)

    def follow(self) -> None:
        """Ask the engine which live settings it runs with (at each Monitor poll): one changed by another client
        of its API (PUT /cache/config from a script) becomes what this app knows the engine runs with, and the
        Settings tab says so; Apply then sends this app's settings back, Revert keeps the engine's."""
        if self._following or self._sending or self.box is not None or self.engine.state is not EngineState.READY:
            return
        self._following = True
        sends, asked = self._sends, self.engine.config

        def done(reply: Reply) -> None:
            self._following = False
            running = self.engine.config
            if (not reply.ok or sends != self._sends or self._sending or self.box is not None or running is None
                    or running is not asked or self.engine.state is not EngineState.READY):
                return  # an answer from before this app's own change, while it is under way, or of an engine since
                # restarted (a start gives the engine a new config)
            try:
                body = parse(CacheConfigBody, reply.data, "GET /cache/config")
            except ContractError:
                return  # fetch_cache_config says so in the status bar
            changed = {k: v for k, v in body.settings.items() if hasattr(running, k) and getattr(running, k) != v}
            if not changed:
                return
            self.engine.config = running.replace(**changed)
            self.tab.set_engine(self.engine.state, self.engine.config)
            self.tab.set_effective_dir(body.effective_dir)
            names = ", ".join(f"{label_of(k)} = {v}" for k, v in changed.items())
            self.tab.show_result(f"Changed in the running engine by another client of its API: {names}. Apply, "
                                 "or the next live change made here, sends this app's settings to it again; Revert "
                                 "keeps the engine's.", True)

        self.client.request("GET", "/cache/config", done)

    def fetch_cache_config(self) -> None:
        """The folder the engine really uses (the setting may be empty: the default folder)."""
        def done(reply: Reply) -> None:
            if not reply.ok:
                return
            try:
                body = parse(CacheConfigBody, reply.data, "GET /cache/config")
            except ContractError as exc:
                self.status(f"The engine's cache settings are not understood: {exc}", 15000)
                return
            self.tab.set_effective_dir(body.effective_dir)

        self.client.request("GET", "/cache/config", done)
