"""The control calls, run on the engine thread: slot files (save, restore, erase), the cache's stats,
purge and live settings."""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

import torch

from engine import __version__
from engine.config import setting_of
from engine.errors import BadValue, Busy, NotFound, Refused
from engine.figures import CacheFigures
from engine.runtime.startup import Startup
from engine.runtime.state import Slot

if TYPE_CHECKING:
    pass

log = logging.getLogger("strata.engine")


class Control(Startup):
    """Operations the server runs between steps (`Engine.run`)."""

    def slots_info(self) -> list[dict]:
        return [
            {
                "id": s.id,
                "state": "busy" if s.active or s.restoring else "idle",
                "n_tokens": len(s.tokens),
                "n_ctx": self.ctx_size,
                "last_used": s.last_used or None,
            }
            for s in self.slots
        ]

    def _slot_for_file_op(self, slot_id: int) -> Slot:
        if not 0 <= slot_id < self.n_slots:
            raise NotFound(f"slot {slot_id} does not exist; slots are 0..{self.n_slots - 1}", param="id")
        slot = self.slots[slot_id]
        if slot.active is not None or slot.restoring:
            raise Busy(f"slot {slot_id} is busy with a request; try again when it is idle", param="id")
        return slot

    def _session_path(self, filename: Any) -> str:
        from engine.cache.session_file import safe_session_path

        if not self.config.slot_save_path:
            raise BadValue("slot files are disabled: start the engine with --slot-save-path DIR")
        if not isinstance(filename, str):
            raise BadValue("expected a JSON body {\"filename\": \"name\"} with a string filename", param="filename")
        try:
            return safe_session_path(self.config.slot_save_path, filename)
        except ValueError as exc:
            raise BadValue(str(exc), param="filename") from exc

    def save_slot(self, slot_id: int, filename: Any) -> dict:
        from engine.cache.session_file import SessionFileError, save_session

        slot = self._slot_for_file_op(slot_id)
        path = self._session_path(filename)
        if not slot.tokens:
            raise BadValue(f"slot {slot_id} is empty: nothing to save", param="id")
        os.makedirs(self.config.slot_save_path or ".", exist_ok=True)
        t0 = time.perf_counter()
        n = len(slot.tokens)
        checkpoints = self.memory.session_checkpoints(slot.id, n)
        try:
            nbytes = save_session(path, self._session_identity(), slot.tokens, self.kv.read(slot.id, 0, n),
                                  engine_version=__version__, checkpoints=checkpoints)
        except SessionFileError as exc:
            raise BadValue(str(exc), param="filename") from exc
        ms = (time.perf_counter() - t0) * 1000
        log.info("slot %d saved to %s: %d tokens, %d bytes, %.1f ms", slot_id, os.path.basename(path), n, nbytes, ms)
        return {"id_slot": slot_id, "filename": os.path.basename(path), "n_saved": n, "n_written": nbytes,
                "timings": {"save_ms": ms}}

    def restore_slot(self, slot_id: int, filename: Any) -> dict:
        from engine.cache.session_file import SessionFileError, load_session_parts

        slot = self._slot_for_file_op(slot_id)
        path = self._session_path(filename)
        if not (os.path.isfile(path) or os.path.isdir(path)):  # a folder is refused as one by load_session_parts
            raise NotFound(f"no session file named {os.path.basename(path)!r} in the slot save path", param="filename")
        t0 = time.perf_counter()
        try:
            tokens, kv, states = load_session_parts(path, self._session_identity())
        except SessionFileError as exc:
            raise BadValue(f"{os.path.basename(path)}: {exc}", param="filename") from exc
        if len(tokens) > self.ctx_size:
            raise BadValue(f"the file holds {len(tokens)} tokens but a slot holds {self.ctx_size}", param="filename")
        self._write_slot(slot, tokens, kv, states)
        ms = (time.perf_counter() - t0) * 1000
        log.info("slot %d restored from %s: %d tokens, %.1f ms", slot_id, os.path.basename(path), len(tokens), ms)
        return {"id_slot": slot_id, "filename": os.path.basename(path), "n_restored": len(tokens),
                "n_read": int(kv.nbytes), "timings": {"restore_ms": ms}}

    def erase_slot(self, slot_id: int) -> dict:
        slot = self._slot_for_file_op(slot_id)
        n = len(slot.tokens)
        slot.tokens, slot.conversation_id, slot.unnamed = [], None, []
        self.kv.clear(slot.id)
        self.memory.clear(slot.id)
        return {"id_slot": slot_id, "n_erased": n}


    def _write_slot(self, slot: Slot, tokens: list[int], kv: torch.Tensor, states: dict | None = None) -> None:
        slot.tokens, slot.conversation_id, slot.unnamed = [], None, []  # a session file is no parked conversation
        try:
            self.kv.write(slot.id, 0, kv)
            self.memory.put_session(slot.id, len(tokens), states)  # a hybrid model: its state after those tokens
        except BaseException:
            self.kv.clear(slot.id)
            self.memory.clear(slot.id)
            raise
        slot.tokens = list(tokens)

    def cache_figures(self) -> CacheFigures:
        if self.cache is None:
            return CacheFigures(enabled=False, storage=self.config.conversation_cache_storage)
        return self.cache.stats()

    def cache_stats(self) -> dict:
        return self.cache_figures().to_dict()

    def cache_conversations(self) -> list[dict]:
        if self.cache is None:
            return []
        return [c.to_dict() for c in self.cache.conversations()]

    def set_conversation(self, conv_id: str, *, priority: str | None, pinned: bool | None) -> list[dict]:
        """Change a parked conversation's priority and/or pin; its rows (one per tier) as they are now."""
        if self.cache is None:
            raise NotFound(f"conversation {conv_id!r} is not parked: the conversation cache is off", param="id")
        try:
            target = self.cache.set_attrs(conv_id, priority=priority, pinned=pinned)
        except KeyError:
            raise NotFound(f"conversation {conv_id!r} is not parked; GET /cache/conversations lists those that are",
                           param="id") from None
        except ValueError as exc:
            raise BadValue(str(exc), param="priority") from None
        log.info("conversation %s: priority %s, pinned %s", target, priority or "unchanged",
                 "unchanged" if pinned is None else pinned)
        return [c.to_dict() for c in self.cache.conversations() if c.id == target]

    def drop_conversation(self, conv_id: str) -> dict:
        """Drop one parked conversation from every tier; what was dropped and what was skipped (a PurgeBody)."""
        if self.cache is None:
            raise NotFound(f"conversation {conv_id!r} is not parked: the conversation cache is off", param="id")
        try:
            result = self.cache.drop(conv_id).to_dict()
        except KeyError:
            raise NotFound(f"conversation {conv_id!r} is not parked; GET /cache/conversations lists those that are",
                           param="id") from None
        log.info("conversation %s dropped: %s", conv_id, result)
        return result

    def cache_events(self, limit: int = 200) -> list[dict]:
        return [] if self.cache is None else self.cache.events(limit)

    def purge_cache(self, tier: str) -> dict:
        if tier not in ("ram", "disk", "all"):
            raise BadValue(f'tier: expected one of ram, disk, all, got "{tier}"', param="tier")
        if self.cache is None:
            return {"tier": tier, "dropped": {"conversations": 0, "bytes": 0}, "skipped": []}
        result = self.cache.purge(tier).to_dict()
        log.info("cache purge %s: %s", tier, result)
        return result

    def cache_config(self) -> dict:
        from engine.config import LIVE_SETTINGS

        return {
            "settings": {name: getattr(self.config, name) for name in LIVE_SETTINGS},
            "live": list(LIVE_SETTINGS),
            "effective_dir": self.config.cache_dir,
            "enabled": self.cache is not None,
        }

    def update_cache_config(self, changes: dict) -> dict:
        from engine.config import LIVE_SETTINGS, SettingError

        if not isinstance(changes, dict) or not changes:
            raise BadValue("expected a JSON object of settings to change, e.g. {\"conversation_cache_mib\": 2048}")
        parsed: dict[str, Any] = {}
        for name, value in changes.items():
            if name not in LIVE_SETTINGS:
                try:
                    setting_of(name)
                except KeyError:
                    raise BadValue(f"unknown setting {name!r}; live settings: {', '.join(LIVE_SETTINGS)}",
                                   param=name) from None
                raise BadValue(f"{name} cannot change on a running engine; restart with the new value",
                               param=name)
            try:
                parsed[name] = setting_of(name).parse(value)
            except SettingError as exc:
                raise BadValue(str(exc), param=name) from exc
        new_config = self.config.replace(**parsed)
        changed = [n for n in parsed if getattr(self.config, n) != getattr(new_config, n)]
        self._restores.wait()  # a read in flight finishes on the cache it began on (its pins hold its files)
        if self.cache is None and changed:
            from engine.cache.errors import CacheError

            try:
                self.cache = self._make_cache(new_config)
            except (CacheError, ValueError, OSError) as exc:
                raise Refused(f"the cache could not start with the new settings: {exc}") from exc
            self.config = new_config
        elif self.cache is not None and changed:
            from engine.cache import CacheSettings
            from engine.cache.errors import CacheError

            try:
                self.cache.reconfigure(CacheSettings.from_engine_config(new_config))
            except (CacheError, ValueError, OSError) as exc:
                raise Refused(f"the cache could not switch to the new settings, nothing changed: {exc}") from exc
            self.config = new_config
        log.info("cache config changed: %s", ", ".join(f"{n}={getattr(new_config, n)}" for n in changed) or "nothing")
        return {**self.cache_config(), "changed": changed}
