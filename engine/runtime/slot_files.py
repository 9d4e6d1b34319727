"""Slot files (llama-server's /slots?action=save|restore|erase): one slot's tokens and K/V (and a hybrid model's
state) written to or read from a session file under --slot-save-path (engine thread only)."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from engine import __version__
from engine.cache.identity import CacheIdentity
from engine.errors import BadValue, NotFound
from engine.runtime.slot_set import SlotSet

log = logging.getLogger("strata.engine")


class SlotFiles:
    """Save, restore and erase slots; `folder` is --slot-save-path ("" = slot files disabled)."""

    def __init__(self, slots: SlotSet, folder: str, identity: CacheIdentity) -> None:
        self.slots = slots
        self.folder = folder
        self.identity = identity  # a session file's (every layer's K/V): identity.session_identity

    def _path(self, filename: Any) -> str:
        from engine.cache.session_file import safe_session_path

        if not self.folder:
            raise BadValue("slot files are disabled: start the engine with --slot-save-path DIR")
        if not isinstance(filename, str):
            raise BadValue("expected a JSON body {\"filename\": \"name\"} with a string filename", param="filename")
        try:
            return safe_session_path(self.folder, filename)
        except ValueError as exc:
            raise BadValue(str(exc), param="filename") from exc

    def save(self, slot_id: int, filename: Any) -> dict:
        from engine.cache.session_file import SessionFileError, save_session

        slot = self.slots.idle(slot_id)
        path = self._path(filename)
        if not slot.tokens:
            raise BadValue(f"slot {slot_id} is empty: nothing to save", param="id")
        os.makedirs(self.folder, exist_ok=True)
        t0 = time.perf_counter()
        n = len(slot.tokens)
        checkpoints = self.slots.memory.session_checkpoints(slot.id, n)
        try:
            nbytes = save_session(path, self.identity, slot.tokens, self.slots.kv.read(slot.id, 0, n),
                                  engine_version=__version__, checkpoints=checkpoints)
        except SessionFileError as exc:
            raise BadValue(str(exc), param="filename") from exc
        ms = (time.perf_counter() - t0) * 1000
        log.info("slot %d saved to %s: %d tokens, %d bytes, %.1f ms", slot_id, os.path.basename(path), n, nbytes, ms)
        return {"id_slot": slot_id, "filename": os.path.basename(path), "n_saved": n, "n_written": nbytes,
                "timings": {"save_ms": ms}}

    def restore(self, slot_id: int, filename: Any) -> dict:
        from engine.cache.session_file import SessionFileError, load_session_parts

        slot = self.slots.idle(slot_id)
        path = self._path(filename)
        if not (os.path.isfile(path) or os.path.isdir(path)):  # a folder is refused as one by load_session_parts
            raise NotFound(f"no session file named {os.path.basename(path)!r} in the slot save path", param="filename")
        t0 = time.perf_counter()
        try:
            tokens, kv, states = load_session_parts(path, self.identity)
        except SessionFileError as exc:
            raise BadValue(f"{os.path.basename(path)}: {exc}", param="filename") from exc
        if len(tokens) > self.slots.ctx_size:
            raise BadValue(f"the file holds {len(tokens)} tokens but a slot holds {self.slots.ctx_size}",
                           param="filename")
        self.slots.write_session(slot, tokens, kv, states)
        ms = (time.perf_counter() - t0) * 1000
        log.info("slot %d restored from %s: %d tokens, %.1f ms", slot_id, os.path.basename(path), len(tokens), ms)
        return {"id_slot": slot_id, "filename": os.path.basename(path), "n_restored": len(tokens),
                "n_read": int(kv.nbytes), "timings": {"restore_ms": ms}}

    def erase(self, slot_id: int) -> dict:
        return {"id_slot": slot_id, "n_erased": self.slots.erase(self.slots.idle(slot_id))}
