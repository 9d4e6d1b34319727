"""Reading the disk tier back: the pieces of a restore (verified, damaged entries removed) and moving every
entry of one folder into another (reconfigure with a new `dir`). Functions over a `DiskStore`, lock held
where they say so."""

from __future__ import annotations

import errno
import logging

from engine.cache.disk_store import DiskStore
from engine.cache.errors import CacheRestoreError
from engine.cache.fileformat import FileFormatError
from engine.cache.index import Block, Conv
from engine.cache.lifecycle import EntryState
from engine.cache.parts import Parts, parts_nbytes

log = logging.getLogger("strata.cache")


def disk_pieces(
    store: DiskStore, conv: Conv, blocks: list[Block], use_tail: bool, own_state: int | None = None
) -> tuple[list[tuple[int, Parts]], int, Parts | None]:
    """(start, state parts) pieces of a restore from RAM copies or files, the bytes read, and the
    conversation's own checkpoint at `own_state` (a hybrid model's restore that ends there); raises
    CacheRestoreError (after removing what is damaged). The caller pins `conv` and `blocks`, lock not held."""
    b = store.identity.block_tokens
    pieces: list[tuple[int, Parts]] = []
    try:
        for i, blk in enumerate(blocks):
            data = blk.data  # once: the writer may drop the RAM copy of a block it has just written
            pieces.append((i * b, data if data is not None else store.files.read_block(blk.key)))
        if use_tail:
            tail = conv.tail
            if tail is None:
                tail = store.files.read_tail(conv)
                if tail is None:
                    raise FileFormatError("corrupt", "manifest has no state for the partial block")
            pieces.append((len(conv.keys) * b, tail))
        state = None
        if own_state is not None:
            state = conv.checkpoints.get(own_state)
            if state is None:
                state = store.files.read_checkpoints(conv, [own_state])[own_state]
    except (FileFormatError, OSError) as exc:
        message = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        if isinstance(exc, OSError) and exc.errno != errno.ENOENT:  # the disk did not answer: the files may be whole
            log.warning("conversation cache: reading conversation %s failed (%s); kept", conv.id, message)
            raise CacheRestoreError(f"reading parked conversation {conv.id} failed ({message}); prefill instead") from None
        log.warning("conversation cache: conversation %s cannot be restored (%s); removing it", conv.id, message)
        bad = _damaged(store, blocks)  # re-read without the lock: the engine thread's lookups and parks go on
        with store.lock:
            _drop_broken(store, conv, blocks, bad)
        raise CacheRestoreError(f"parked conversation {conv.id} is damaged ({message}); prefill instead") from None
    return pieces, sum(parts_nbytes(p) for _, p in pieces) + parts_nbytes(state), state


def _damaged(store: DiskStore, blocks: list[Block]) -> set[str]:
    """The keys of `blocks` (pinned by the restore) whose files are refused or gone."""
    bad = set()
    for blk in blocks:
        if blk.on_disk and blk.data is None:
            try:
                store.files.read_block(blk.key)
            except FileFormatError:
                bad.add(blk.key)
            except OSError as exc:
                if exc.errno == errno.ENOENT:
                    bad.add(blk.key)
    return bad


def _drop_broken(store: DiskStore, conv: Conv, blocks: list[Block], bad: set[str]) -> None:
    """Remove a damaged conversation and every conversation sharing a damaged block `bad` (lock held)."""
    idx = store.index
    conv.pins -= 1  # the restore's own pins must not keep the damaged entries from going
    for blk in blocks:
        blk.pins -= 1
    try:
        victims = {conv.id} | {c.id for c in idx.convs.values() if bad & set(c.keys)}
        for cid in victims:
            if cid in idx.convs and not idx.is_pinned(idx.convs[cid]):
                store.remove(cid, reason="corrupt")
    finally:
        conv.pins += 1
        for blk in blocks:
            blk.pins += 1


def move_entries(old: DiskStore, new: DiskStore) -> None:
    """Copy every entry of `old` into `new` (verified reads, atomic writes), then remove it from `old`.

    Both writers are stopped; caller holds the lock."""
    block_tokens = old.identity.block_tokens
    for cid in list(old.index.convs):
        conv = old.index.convs[cid]
        if cid in new.index.convs:
            continue
        try:
            missing = [k for k in conv.keys if k not in new.index.blocks]
            sizes = new.files.write_blocks([(k, (lambda k=k: old.files.read_block(k))) for k in missing])
            tail = old.files.read_tail(conv) if conv.n_tokens % block_tokens else None
            checkpoints = old.files.read_checkpoints(conv) if conv.checkpoints else {}
            copy = Conv(cid, conv.tokens, conv.keys, 0, created=conv.created, last_used=conv.last_used,
                        hits=conv.hits, state=EntryState.WRITING, checkpoints=dict.fromkeys(checkpoints))
            copy.set_attrs(conv.attrs)
            copy.nbytes = new.files.write_manifest(copy, tail, checkpoints=checkpoints)
            copy.move(EntryState.WRITTEN)
        except (OSError, FileFormatError) as exc:
            log.warning("conversation cache: could not move %s to %s: %s", cid, new.files.folder, exc)
            continue
        new.index.add(copy, [Block(k, sizes[k], on_disk=True, state=old.index.blocks[k].state) for k in missing])
        c, freed = old.index.remove(cid)
        old.files.delete_conv(c, freed)
