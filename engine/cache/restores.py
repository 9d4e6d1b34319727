"""Restoring a hit: find its entry (following the ids later turns superseded), check it against the hit, gather
its state in host memory from the tier that holds it, hand it to the slot piece by piece, and count it.
`RestoreRead` splits those steps so a disk read can run on another thread than the copy into the slot.

`ConversationCache.restore` (facade.py) delegates here; like disk_parks.py for the disk store, these functions
work on the cache's own lock, tiers and journal. Nothing reaches `write_parts` before every check passed.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.cache import window
from engine.cache.disk_reads import disk_pieces
from engine.cache.errors import CacheRestoreError
from engine.cache.identity import CacheIdentity, tokens_key
from engine.cache.index import Conv, TierIndex
from engine.cache.parts import Parts, WriteParts, check_state, first_tokens, n_tokens_of, parts_nbytes
from engine.cache.stats import CacheHit, RestoreResult

if TYPE_CHECKING:
    from engine.cache.facade import ConversationCache

log = logging.getLogger("strata.cache")
MIB = 1 << 20


def restore(cache: ConversationCache, hit: CacheHit, write_parts: WriteParts) -> RestoreResult:
    """Validate and gather the hit's state in host memory, then `write_parts(start, parts)` for [0, hit.n_tokens).

    Raises CacheRestoreError before the first `write_parts` when anything is wrong; exceptions of `write_parts`
    itself propagate (the engine then clears the slot).
    """
    read = RestoreRead(cache, hit)
    read.read()
    return read.deliver(write_parts)


class RestoreRead:
    """One restore in three steps, so the read can run off the engine thread (engine/runtime/pending_restores.py).

    - constructing it (engine thread, cache lock): find the entry, check it against the hit, pin what a disk
      restore reads; raises CacheRestoreError;
    - `read()` (any thread, no cache lock held while reading files): gather every piece in host memory and verify
      it (checksums, parts, shapes, dtypes); unpins; never raises (a failure is kept for `deliver`);
    - `deliver(write_parts)` (engine thread): raise the read's failure, or hand the pieces to the slot and count
      the restore. Nothing reaches `write_parts` before every check passed. Into a GPU slot the reader delivers
      (`deliver_early`) and the engine thread's `deliver` hands back the outcome.
    """

    def __init__(self, cache: ConversationCache, hit: CacheHit) -> None:
        self.cache, self.hit = cache, hit
        b = cache.identity.block_tokens
        with cache.lock:
            cache.reap()
            if hit.identity_key and hit.identity_key != cache.identity.key:
                cache.journal.count("restore_failures")
                raise CacheRestoreError("the hit was made for another model identity; prefill instead")
            found = find_entry(cache, hit)
            if found is None:
                cache.journal.count("restore_failures")
                raise CacheRestoreError(f"conversation {hit.conversation_id} is no longer parked; prefill instead")
            self.tier, conv = found
            n = hit.n_tokens
            if not 0 < n <= conv.n_tokens:
                cache.journal.count("restore_failures")
                raise CacheRestoreError(f"hit of {n} tokens does not fit conversation {conv.id} ({conv.n_tokens})")
            if hit.tokens_key and tokens_key(cache.identity.key, conv.tokens[:n]) != hit.tokens_key:
                cache.journal.count("restore_failures")
                raise CacheRestoreError(f"conversation {conv.id} no longer holds the hit's tokens; prefill instead")
            n_full = min(len(conv.keys), math.ceil(n / b))
            self.use_tail = n > len(conv.keys) * b
            self.disk = cache.disk if self.tier == "disk" else None
            self.index = dict(cache.sources())[self.tier]
            self.own_state = None  # a hybrid model: the state at n is the conversation's own, else block n_full - 1's
            if cache.identity.local_layers:  # a sliding-window model: the window checkpoint that serves n
                self.own_state = window.checkpoint_for(conv.checkpoints, n)
                if self.own_state is None:
                    cache.journal.count("restore_failures")
                    raise CacheRestoreError(f"conversation {conv.id} keeps no local-layer window for {n} tokens")
            elif cache.identity.state_parts:
                if n in conv.checkpoints:
                    self.own_state = n
                elif not (0 < n == n_full * b and self.index.blocks[conv.keys[n_full - 1]].state):
                    cache.journal.count("restore_failures")
                    raise CacheRestoreError(f"conversation {conv.id} keeps no recurrent state at {n} tokens")
            self.blocks = [self.index.blocks[k] for k in conv.keys[:n_full]]
            # Reading (on the reader thread, for a disk restore or one into a GPU slot): the entry and its
            # blocks stay until read() is done.
            conv.pins += 1
            for blk in self.blocks:
                blk.pins += 1
        self.conv, self.n = conv, n
        self.pieces: list[tuple[int, Parts]] = []
        self.state: Parts | None = None
        self.read_bytes = 0
        self.read_ms = 0.0
        self.error: CacheRestoreError | None = None
        self.done = False
        self._early: RestoreResult | Exception | None = None  # what `deliver_early` got, for `deliver`

    def read(self) -> None:
        """Gather and verify the pieces (the slow part of a disk restore: file reads and xxhash, which release
        the GIL). Safe on any thread; called once."""
        assert not self.done, "a restore is read once"
        cache, conv, t0 = self.cache, self.conv, time.perf_counter()
        try:
            if self.tier == "remote":
                assert cache.remote is not None
                pieces, self.read_bytes = cache.remote.pieces(conv, self.blocks, self.use_tail)
                state = conv.checkpoints.get(self.own_state) if self.own_state is not None else None
            elif self.disk is None:
                pieces, self.read_bytes, state = cache.ram.pieces(conv, self.blocks, self.use_tail, self.own_state)
            else:
                pieces, self.read_bytes, state = disk_pieces(self.disk, conv, self.blocks, self.use_tail,
                                                             self.own_state)
            self.state, self.pieces = _split_state(cache.identity, conv, pieces, state)
            _check_pieces(cache.identity, conv, self.pieces)
            if cache.identity.local_layers:
                self.state = _window_for(cache.identity, conv, self.own_state, self.n, self.state)
        except CacheRestoreError as exc:
            self.error = exc
        except Exception as exc:  # a bug in a read must still be a clean miss for this slot only
            log.exception("conversation cache: reading %s failed", conv.id)
            self.error = CacheRestoreError(f"reading conversation {conv.id} failed ({exc}); prefill instead")
        finally:
            with cache.lock:
                conv.pins -= 1
                for blk in self.blocks:
                    blk.pins -= 1
            self.read_ms = (time.perf_counter() - t0) * 1000
            self.done = True

    def abandon(self) -> None:
        """Release the entry and its blocks without reading them (a restore that could not be started); nothing
        once `read` has run."""
        if self.done:
            return
        with self.cache.lock:
            self.conv.pins -= 1
            for blk in self.blocks:
                blk.pins -= 1
        self.error = CacheRestoreError(f"the restore of conversation {self.conv.id} was not started")
        self.done = True

    def deliver(self, write_parts: WriteParts, *, persist_use: bool = True) -> RestoreResult:
        """Write the read pieces into the slot and count the restore (engine thread, after `read`); raises the
        read's CacheRestoreError before any write. `persist_use=False`: the caller runs `persist_use()` later,
        on another thread (the manifest rewrite is a file write and an fsync)."""
        assert self.done, "deliver() before read() finished: the slot's rows would be written from nothing"
        if self._early is not None:  # delivered on the reader already: hand back what it got, counted now
            early, self._early = self._early, None
            if isinstance(early, Exception):
                raise early
            self._count(early, persist_use)
            return early
        result = self._write(write_parts)
        self._count(result, persist_use)
        return result

    def _write(self, write_parts: WriteParts) -> RestoreResult:
        """Write the read pieces into the slot; raises the read's CacheRestoreError (counted) before any write."""
        cache, n = self.cache, self.n
        if self.error is not None:
            with cache.lock:
                cache.journal.count("restore_failures")
            raise self.error
        t0 = time.perf_counter()
        specs = cache.identity.parts
        for start, parts in self.pieces:
            if start >= n:
                break
            have = n_tokens_of(specs, parts)
            take = min(have, n - start)
            write_parts(start, parts if take == have else first_tokens(specs, parts, take))
        if self.state is not None:
            write_parts(n, self.state)  # the recurrent state (or the local layers' window) after exactly n tokens
        ms = self.read_ms + (time.perf_counter() - t0) * 1000  # the read and the copy, not the wait between
        nbytes = n * cache.identity.bytes_per_token + parts_nbytes(self.state)
        self.pieces, self.state = [], None  # the slot holds them now
        return RestoreResult(n, nbytes, ms, self.tier)

    def _count(self, result: RestoreResult, persist_use: bool) -> None:
        """The restore in the entry's use and hits, the figures and the log: once the slot takes it (a restore
        delivered early and then dropped, its conversation purged meanwhile, is not one)."""
        cache, conv = self.cache, self.conv
        n, nbytes, ms, tier = result.n_tokens, result.nbytes, result.ms, result.tier
        index, disk = self.index, self.disk
        with cache.lock:
            conv.hits += 1
            conv.last_used = time.time()
            if conv.id in index.convs:
                index.touch(conv.id)
            if persist_use and disk is not None and cache.disk is disk:
                disk.record_use(conv)
            for name, value in (("restores", 1), ("hits", 1), ("tokens_reused", n), ("bytes_restored", nbytes)):
                cache.journal.count(name, value)
            cache.journal.restored(tier, self.read_bytes, ms)
            cache.journal.event("restore", conv.id, n, nbytes, ms, tier)
        log.info("conversation cache: restored %s from %s: %d tokens, %.1f MiB, %.1f ms (read %.1f ms)",
                 conv.id, tier, n, nbytes / MIB, ms, self.read_ms)

    def deliver_early(self, write_parts: WriteParts, landed: Callable[[], None]) -> None:
        """The writes of `deliver` on the reader thread right after `read` (a slot on a GPU: `write_parts` issues
        copies on a copy stream, `landed()` then waits for them, also after a failed write); the engine thread's
        later `deliver` counts the restore and returns the result, or raises the error (a failure of `landed`
        too), writing nothing again."""
        assert self.done and self._early is None, "deliver_early() before read() or twice"
        try:
            try:
                result = self._write(write_parts)
            finally:  # rows already sent must land before the engine clears the slot
                landed()
            self._early = result
        except Exception as exc:  # raised to the engine thread by deliver(), where a failure is a clean miss
            self._early = exc

    def persist_use(self) -> None:
        """Rewrite a disk entry's manifest with its new last use and hit count (any thread, after `deliver`);
        an entry evicted or superseded meanwhile is skipped (`record_use` checks under the lock)."""
        cache, disk = self.cache, self.disk
        if disk is None:
            return
        with cache.lock:
            if cache.disk is disk:
                disk.record_use(self.conv)


def resume_point(identity: CacheIdentity, index: TierIndex, conv: Conv, n: int) -> int:
    """The deepest position <= n a restore of `conv` can resume from when it keeps checkpoints (a hybrid
    model's recurrent state, a sliding-window model's local window), else n."""
    if identity.local_layers:
        return n if window.checkpoint_for(conv.checkpoints, n) is not None else 0
    return index.checkpoint_at_most(conv, n, identity.block_tokens)


def _window_for(identity: CacheIdentity, conv: Conv, position: int | None, n: int, state: Parts | None) -> Parts:
    """The local rows a resume at n reads, cut from the conversation's window checkpoint at `position`."""
    spec = identity.state_parts[0]
    assert position is not None and state is not None and identity.window, (position, identity.window)
    rows = state[spec.name]
    if rows.shape[spec.token_axis] != conv.n_tokens - window.first_row(position, identity.window):
        raise CacheRestoreError(f"conversation {conv.id}: its local-layer window has {rows.shape} rows")
    return {spec.name: window.cut(rows, position, n, identity.window, spec.token_axis)}


def find_entry(cache: ConversationCache, hit: CacheHit) -> tuple[str, Conv] | None:
    """The tier and entry a hit (or an id superseded by a later turn) names now, or None."""
    conv_id = hit.conversation_id
    redirects = cache.journal.redirects
    for _ in range(16):
        tiers = sorted(cache.sources(), key=lambda t: t[0] != hit.tier)
        for tier, index in tiers:
            conv = index.convs.get(conv_id)
            if conv is not None and not conv.failed and conv.n_tokens >= hit.n_tokens:
                return tier, conv
        if conv_id not in redirects:
            return None
        conv_id = redirects[conv_id]
    return None


def _split_state(
    identity: CacheIdentity, conv: Conv, pieces: list[tuple[int, Parts]], state: Parts | None
) -> tuple[Parts | None, list[tuple[int, Parts]]]:
    """(the checkpoint to restore, the pieces' K/V without the checkpoints stored in blocks); for a hybrid
    model the checkpoint is the conversation's own one or the last block's, verified against the identity."""
    specs = identity.state_parts
    if not specs:
        return None, pieces
    if state is None and pieces:
        state = {s.name: pieces[-1][1][s.name] for s in specs if s.name in pieces[-1][1]}
    try:
        state = check_state(specs, state or {})
    except ValueError as exc:
        raise CacheRestoreError(f"conversation {conv.id}: stored recurrent state is wrong ({exc})") from None
    token_names = {s.name for s in identity.parts}
    return state, [(start, {k: v for k, v in p.items() if k in token_names}) for start, p in pieces]


def _check_pieces(identity: CacheIdentity, conv: Conv, pieces: list[tuple[int, Parts]]) -> None:
    """Every part of every piece has its spec's shape and dtype, and a full block's piece is a whole block."""
    specs, b = identity.parts, identity.block_tokens
    for start, parts in pieces:
        n = n_tokens_of(specs, parts) if set(parts) == {s.name for s in specs} else -1
        if n < 0 or (start < len(conv.keys) * b and n != b) or any(
            tuple(parts[s.name].shape) != s.shape(n) or parts[s.name].dtype != s.dtype for s in specs
        ):
            raise CacheRestoreError(f"conversation {conv.id}: stored state has the wrong parts, shape or dtype")
