"""Parking a conversation on the disk tier: staged in host memory for the writer, or written before the
park returns (disk mode, and the tiered cache's fallback when RAM cannot take it)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np

from engine.cache.attrs import ConvAttrs
from engine.cache.disk_files import os_reason
from engine.cache.errors import ParkRefused
from engine.cache.index import Block, Conv
from engine.cache.lifecycle import EntryState
from engine.cache.parts import NO_CHECKPOINTS, Checkpoints, Parts, ReadParts, parts_nbytes
from engine.cache.policy import rank_of
from engine.cache.ram_tier import capture, inherit

if TYPE_CHECKING:
    from engine.cache.disk_store import DiskStore, Reservation

log = logging.getLogger("strata.cache")


def park(
    store: DiskStore,
    toks: np.ndarray,
    keys: list[str],
    read_parts: ReadParts,
    keep: str | None,
    attrs: ConvAttrs,
    *,
    background: bool = True,
    states: Checkpoints = NO_CHECKPOINTS,
) -> tuple[Conv, int, int]:
    """Park on disk; returns (entry, new bytes, evictions). Raises ParkRefused; nothing changed then.

    With `background`, the new K/V is captured into host memory and queued for the writer: the park
    returns without waiting on the disk and the entry is served from that copy until written, within the
    staging bound. A park that cannot fit the bound (or without `background`) writes its files now.
    """
    if not store.usable or not store.settings.uses_disk:
        raise ParkRefused("disk_unavailable", store.files.error or "no disk tier")
    idx, b = store.index, store.identity.block_tokens
    with store.lock:
        candidates = [c for c in idx.prefixes_of(toks) if not c.failed]
        superseded = [c for c in candidates if not idx.is_pinned(c)]
        same = [c for c in candidates if c.n_tokens == len(toks)]  # parked (written or on its way)
        resolved = attrs.resolve(candidates)
        rank = rank_of(resolved[0])
        if same:
            same[0].set_attrs(resolved)
            same[0].last_used = time.time()
            idx.touch(same[0].id)
            store.record_use(same[0])
            return same[0], 0, 0
        held = idx.matched_blocks(keys)
        states = states.settled(held, lambda i: idx.blocks[keys[i]].state, b)
        have, victims = store.room(
            keys,
            len(toks),
            leaving={c.id for c in candidates},
            exclude={keep} if keep else set(),
            rank=rank,
            in_flight_ok=True,  # an entry being written may go (its files once written); one being read not
            states=states,
        )
        n_tail = len(toks) - len(keys) * b
        staged = ((len(keys) - have) * store.identity.block_bytes + n_tail * store.identity.bytes_per_token
                  + states.new_blocks(have) * store.identity.state_bytes + states.own_bytes)
        protect = {c.id for c in candidates} | set(victims) | ({keep} if keep else set())
        background = background and store.writer is not None and store.staging.make_room(staged, protect, rank)
        res = store.reserve(keys, have, victims, pin_pending=not background)
        # a staged entry continues its line's id even while that line's last version is being written
        line = inherit(candidates if background else superseded)
        # Written now, under the id of a version only queued: the writer must not start on that version while
        # this park writes the same files without the lock (it would publish the shorter one over this, and the
        # index would hold two entries of one id). Queued again if this park fails.
        held_back = [c.id for c in superseded if not background and store.writer is not None
                     and c.state is EntryState.PENDING]
        for cid in held_back:
            assert store.writer is not None
            store.writer.forget(cid)
    if background:
        return _stage(store, toks, keys, read_parts, res, candidates, line, resolved, states)
    try:
        return _write_now(store, toks, keys, read_parts, res, superseded, line, resolved, states)
    except ParkRefused:
        with store.lock:
            for cid in held_back:
                if cid in idx.convs and store.writer is not None:
                    store.writer.submit(cid)
        raise


def _capture(store: DiskStore, read_parts: ReadParts, start: int, end: int, state: Parts | None = None) -> Parts:
    data = capture(store.identity, read_parts, start, end)
    return data if state is None else {**data, **state}  # a checkpoint at a block's end is stored with it


def _stage(store: DiskStore, toks, keys, read_parts: ReadParts, res: Reservation, superseded: list[Conv], line,
           attrs, states: Checkpoints) -> tuple[Conv, int, int]:
    """Capture a park's new K/V into host memory and queue its write; the entry is restorable at once."""
    b, have = store.identity.block_tokens, len(res.reused)
    conv_id, created, hits = line
    idx = store.index
    new_blocks: list[Block] = []
    tail = None
    try:
        for i in range(have, len(keys)):
            data = _capture(store, read_parts, i * b, (i + 1) * b, states.blocks.get(i))
            has = i in states.blocks
            new_blocks.append(Block(keys[i], store.files.block_size(has), data=data, state=has))
        if len(toks) > len(keys) * b:
            tail = _capture(store, read_parts, len(keys) * b, len(toks))
    except Exception as exc:
        with store.lock:
            store.rollback(res, {})
        if isinstance(exc, ParkRefused):
            raise
        log.exception("conversation cache: reading the slot's K/V failed")
        raise ParkRefused("read_error", f"reading the slot's K/V failed: {exc}") from None
    with store.lock:
        for cid in res.victims:
            if cid in idx.convs:
                store.evict(cid)
        previous = None
        later: list[str] = []
        for old in superseded:
            if idx.convs.get(old.id) is not old:
                continue
            if old.id == conv_id:
                # the same conversation line: this entry takes its place. The version written (or being
                # written) stays the file on disk, and comes back on a failed write, until this one's
                # manifest replaces it; a version only queued is superseded before it was ever written.
                previous = old if old.on_disk or old.busy else old.previous
                later += [c for c in old.supersedes if c != conv_id]
                if previous is not old:
                    old.previous = None
                idx.remove(old.id)
            else:
                later.append(old.id)  # dropped once this entry is written
        conv = Conv(
            conv_id,
            toks,
            keys,
            store.files.manifest_size(len(toks), len(states.own), states.own_bytes),
            tail=tail,
            created=created,
            last_used=time.time(),
            hits=hits,
            state=EntryState.PENDING,
            supersedes=later,
            previous=previous,
            checkpoints=dict(states.own),
        )
        conv.set_attrs(attrs)
        store.publish(res, conv, new_blocks, {})
        assert store.writer is not None
        store.writer.submit(conv_id)
    new_bytes = (sum(parts_nbytes(blk.data) for blk in new_blocks) + parts_nbytes(tail)
                 + states.own_bytes)
    return conv, new_bytes, len(res.victims)


def _write_now(store: DiskStore, toks, keys, read_parts: ReadParts, res: Reservation, superseded: list[Conv], line,
               attrs, states: Checkpoints) -> tuple[Conv, int, int]:
    """Write a conversation's new blocks and its manifest before returning."""
    b, have = store.identity.block_tokens, len(res.reused)
    conv_id, created, hits = line
    idx = store.index

    def capture(i: int):
        return lambda: _capture(store, read_parts, i * b, (i + 1) * b, states.blocks.get(i))

    written: dict[str, int] = {}
    try:
        items = [(k, t) for k, t in res.pinned if t is not None]
        items += [(keys[i], capture(i)) for i in range(have, len(keys))]
        written = store.files.write_blocks(items)
        n_tail = len(toks) - len(keys) * b
        tail = _capture(store, read_parts, len(keys) * b, len(toks)) if n_tail else None
        conv = Conv(conv_id, toks, keys, 0, created=created, last_used=time.time(), hits=hits,
                    state=EntryState.WRITING, checkpoints=dict(states.own))
        conv.set_attrs(attrs)
        conv.nbytes = store.files.write_manifest(conv, tail)
        conv.move(EntryState.WRITTEN)
        conv.checkpoints = dict.fromkeys(conv.checkpoints)  # on disk now: RAM keeps only the positions
    except Exception as exc:
        with store.lock:
            store.rollback(res, written)
            if isinstance(exc, OSError):
                store.files.write_failed(f"conversation {conv_id}", os_reason(exc))
        if isinstance(exc, ParkRefused):
            raise
        if isinstance(exc, OSError):
            raise ParkRefused(
                "disk_error",
                f"writing to {store.files.folder} failed: {exc.strerror or exc}; nothing on disk was lost",
            ) from None
        log.exception("conversation cache: parking to disk failed")
        raise ParkRefused("read_error", f"parking to disk failed: {exc}") from None
    with store.lock:
        store.files.write_succeeded()
        new_blocks = [Block(keys[i], written[keys[i]], on_disk=True, state=i in states.blocks)
                      for i in range(have, len(keys))]
        for old in superseded:
            # not `is_pinned`: the blocks this park reuses are pinned by its own reservation. Nothing begins to
            # read or write `old` meanwhile (restores begin on this thread; its queued write was held back).
            if idx.convs.get(old.id) is not old or old.busy or (old.previous is not None and old.previous.busy):
                continue
            if old.id == conv_id:
                idx.remove(old.id)  # its manifest file was just replaced by the new one
            else:
                store.remove(old.id)
                store.journal.redirect(old.id, conv_id)
        store.publish(res, conv, new_blocks, written)
        for cid in res.victims:
            if cid in idx.convs:
                store.evict(cid)
    return conv, sum(written.values()) + conv.nbytes, len(res.victims)

