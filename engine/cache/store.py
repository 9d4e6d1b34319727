"""The conversation cache: park a slot's K/V, find the longest reusable prefix, restore it, under budgets.

One block store with two tiers (`TierIndex` in RAM, `DiskTier` on disk) and three modes:
- ram: blocks live in RAM; evicted conversations are dropped.
- disk: a park captures the slot's new K/V into host memory and queues it for the background writer, then
  returns: a switch never waits on the disk. Until written, the entry is served from that RAM copy; once
  written, RAM keeps only the index. The RAM held by pending writes is bounded by `spill_queue_bytes` (the
  oldest pending write is dropped and counted to make room; a park bigger than the bound alone is streamed to
  its files before returning). A failed write is counted (`spill_failed`) and logged, and loses nothing that was
  already on disk: a re-park's previous written version stays the file on disk until replaced.
- tiered: parks go to RAM; what RAM evicts is queued for the same background writer (served from its RAM copy
  until written, under the same bound); `close(spill=True)` writes everything parked.
`flush(timeout)` waits for pending writes; `close` waits for them within its deadline (logged if hit).
The engine thread is the only caller of mutating methods; `stats`, `conversations` and `events` may be called
from any thread. The writer thread only writes files and flips flags under the same lock; removals it asks for
are carried out by the engine thread (`_reap`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

import numpy as np
import psutil
import torch

from engine.cache.disk_tier import DAY, DiskTier
from engine.cache.errors import CacheRestoreError
from engine.cache.fileformat import FileFormatError
from engine.cache.identity import CacheIdentity, block_keys, token_array
from engine.cache.index import Block, Conv, TierIndex
from engine.cache.settings import CacheSettings
from engine.cache.stats import (
    CacheHit,
    CacheStats,
    ConversationInfo,
    ParkResult,
    PurgeResult,
    RestoreResult,
    TimingWindow,
)

log = logging.getLogger("strata.cache")
MIB = 1 << 20
_RESERVED = "\x00park"  # holder token of blocks reserved by a park in progress
ReadKV = Callable[[int, int], torch.Tensor]
WriteKV = Callable[[int, torch.Tensor], None]


class _Refused(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class ConversationCache:
    """Parked conversations of one model identity, in RAM and/or on disk."""

    def __init__(self, settings: CacheSettings, identity: CacheIdentity, *, engine_version: str) -> None:
        if settings.block_tokens != identity.block_tokens:
            raise ValueError(
                f"block_tokens: settings say {settings.block_tokens}, identity says {identity.block_tokens}"
            )
        self.settings = settings
        self.identity = identity
        self.engine_version = engine_version
        self.prefill_tokens_per_s: float | None = None
        self._lock = threading.RLock()
        self._ram = TierIndex("ram")
        self._disk: DiskTier | None = None
        self._writer: _SpillWriter | None = None
        self._redirects: OrderedDict[str, str] = OrderedDict()
        self._orphans: set[Conv] = set()  # evicted while being written: their files go once the write ends
        self._events: deque[dict] = deque(maxlen=1000)
        self._park_ms = TimingWindow()
        self._restore_ms = TimingWindow()
        self._bandwidth = {"ram": 4e9, "disk": 1e9}  # bytes/s; replaced by measurements after restores
        self._next_expiry = 0.0
        self._c = dict.fromkeys(
            (
                "hits",
                "misses",
                "tokens_reused",
                "parks",
                "restores",
                "restore_failures",
                "evictions",
                "spills",
                "spill_dropped",
                "spill_failed",
                "bytes_parked",
                "bytes_restored",
                "bytes_spilled",
            ),
            0,
        )
        self._refusals: dict[str, int] = {}
        self._declined: dict[str, int] = {}
        if settings.uses_disk:
            self._disk = self._open_disk(settings.dir, settings.days)
            self._start_writer()
            self._enforce_budgets()
        log.info(
            "conversation cache: storage %s, RAM %d MiB, disk %d MiB, %d slots, blocks of %d tokens (%.2f MiB)",
            settings.storage,
            settings.ram_bytes // MIB,
            settings.disk_bytes // MIB,
            settings.slots,
            identity.block_tokens,
            identity.block_bytes / MIB,
        )

    # ------------------------------------------------------------------ lookup

    def lookup(self, tokens: Sequence[int], *, live_prefix: int = 0) -> CacheHit | None:
        """The longest parked prefix of `tokens` worth restoring (beyond `live_prefix`), or None. Read-only."""
        toks = token_array(tokens)
        if len(toks) < 2 or not self.settings.enabled:
            return None
        keys = block_keys(self.identity.key, toks, self.identity.block_tokens)
        with self._lock:
            self._reap()  # a failed write gives its conversation's written version back before matching
            best: tuple[int, str, Conv] | None = None
            for tier, index in self._tiers():
                for conv in index.candidates(keys):
                    if conv.failed:
                        continue
                    n = min(_common_prefix(toks, conv.tokens), len(toks) - 1)
                    if best is None or n > best[0]:
                        best = (n, tier, conv)
            if best is None or best[0] <= max(live_prefix, 0):
                return None
            n, tier, conv = best
            reason = self._decline_reason(n, len(toks), live_prefix, tier)
            if reason:
                self._declined[reason] = self._declined.get(reason, 0) + 1
                return None
            return CacheHit(conv.id, n, tier, n * self.identity.layout.bytes_per_token, self.identity.key)

    def _decline_reason(self, n: int, n_request: int, live_prefix: int, tier: str) -> str:
        s = self.settings
        if s.n_min and n < s.n_min:
            return "n_min"
        if s.similarity and n / n_request < s.similarity:
            return "similarity"
        rate = self.prefill_tokens_per_s
        if rate and rate > 0:
            b = self.identity.block_tokens
            read_bytes = math.ceil(n / b) * b * self.identity.layout.bytes_per_token
            restore_s = read_bytes / self._bandwidth[tier]
            prefill_s = (n - max(live_prefix, 0)) / rate
            if restore_s >= prefill_s:
                return "cost"
        return ""

    def record_miss(self) -> None:
        with self._lock:
            self._c["misses"] += 1

    # ------------------------------------------------------------------ park

    def park(self, tokens: Sequence[int], read_kv: ReadKV, *, keep: str | None = None) -> ParkResult:
        """Park a slot's conversation: `tokens` are exactly the tokens whose K/V `read_kv(start, end)` returns.

        Captures only blocks this tier does not hold yet. `keep` names a conversation that must not be evicted
        (the hit about to be restored into this slot). Never raises for a refusal: see `ParkResult.reason`.
        """
        t0 = time.perf_counter()
        try:
            toks = token_array(tokens)
        except ValueError as exc:
            return self._refuse("bad_tokens", str(exc), 0)
        with self._lock:
            self._reap()
            self._expire_if_due()
        if not self.settings.enabled:
            return self._refuse("off", "the conversation cache is off", len(toks))
        if len(toks) == 0:
            return self._refuse("empty", "nothing to park", 0)
        keys = block_keys(self.identity.key, toks, self.identity.block_tokens)
        try:
            if self.settings.uses_ram:
                try:
                    conv, new_bytes, evicted = self._park_ram(toks, keys, read_kv, keep)
                    tier = "ram"
                except _Refused as exc:
                    fallback = self.settings.storage == "tiered" and exc.reason in (
                        "larger_than_budget",
                        "min_free",
                    )
                    if not (fallback and self._disk is not None):
                        raise
                    log.info("conversation cache: %s; parking on disk instead", exc)
                    # written before returning: staging it in RAM would defeat the reason RAM refused it
                    conv, new_bytes, evicted = self._park_disk(toks, keys, read_kv, keep, background=False)
                    tier = "disk"
            else:
                conv, new_bytes, evicted = self._park_disk(toks, keys, read_kv, keep)
                tier = "disk"
        except _Refused as exc:
            return self._refuse(exc.reason, str(exc), len(toks))
        ms = (time.perf_counter() - t0) * 1000
        with self._lock:
            self._c["parks"] += 1
            self._c["bytes_parked"] += new_bytes
            self._park_ms.add(ms)
            self._event("park", conv.id, len(toks), new_bytes, ms, tier)
        log.info(
            "conversation cache: parked %s in %s: %d tokens, %.1f MiB new, %.1f ms",
            conv.id,
            tier,
            len(toks),
            new_bytes / MIB,
            ms,
        )
        return ParkResult(True, conv.id, "", tier, len(toks), new_bytes, ms, evicted)

    def _refuse(self, reason: str, message: str, n_tokens: int) -> ParkResult:
        with self._lock:
            self._refusals[reason] = self._refusals.get(reason, 0) + 1
            self._event("refuse", None, n_tokens, 0, 0.0, "", reason=reason)
        level = logging.DEBUG if reason in ("off", "empty") else logging.WARNING
        log.log(level, "conversation cache: park of %d tokens refused: %s", n_tokens, message)
        return ParkResult(False, None, reason, n_tokens=n_tokens)

    def _inherit(self, superseded: list[Conv]) -> tuple[str, float, int]:
        """Id, creation time and hits of the conversation line a park continues (or a fresh id)."""
        if not superseded:
            return secrets.token_hex(8), time.time(), 0
        latest = max(superseded, key=lambda c: c.last_used)
        return latest.id, min(c.created for c in superseded), sum(c.hits for c in superseded)

    def _check_kv(self, kv: torch.Tensor, n: int) -> torch.Tensor:
        want = self.identity.layout.host_shape(n)
        if tuple(kv.shape) != want or kv.dtype != self.identity.layout.dtype:
            raise _Refused("read_error", f"read_kv returned {tuple(kv.shape)} {kv.dtype}, expected {want}")
        if kv.device.type != "cpu":
            kv = kv.cpu()
        return kv.contiguous()

    def _park_ram(self, toks: np.ndarray, keys: list[str], read_kv: ReadKV, keep: str | None):
        s, idx, b = self.settings, self._ram, self.identity.block_tokens
        bpt = self.identity.layout.bytes_per_token
        with self._lock:
            superseded = idx.prefixes_of(toks)
            same = [c for c in superseded if c.n_tokens == len(toks)]
            if same:
                same[0].last_used = time.time()
                idx.touch(same[0].id)
                return same[0], 0, 0
            have = idx.matched_blocks(keys)
            n_tail = len(toks) - len(keys) * b
            own = n_tail * bpt + toks.nbytes
            need = (len(keys) - have) * self.identity.block_bytes + own
            total = len(keys) * self.identity.block_bytes + own
            if total > s.ram_bytes:
                raise _Refused(
                    "larger_than_budget",
                    f"{total / MIB:.1f} MiB conversation is larger than the whole RAM budget ({s.ram_bytes / MIB:.0f} MiB)",
                )
            available = psutil.virtual_memory().available
            if available - need < s.min_free_bytes:
                raise _Refused(
                    "min_free",
                    f"parking {need / MIB:.1f} MiB would leave {max(available - need, 0) / MIB:.0f} MiB of host memory "
                    f"available, under the {s.min_free_bytes / MIB:.0f} MiB floor",
                )
            victims = idx.plan_room(
                need_bytes=need,
                budget=s.ram_bytes,
                slots=s.slots,
                keep_keys=set(keys),
                leaving={c.id for c in superseded},
                exclude={keep} if keep else set(),
            )
            if victims is None:
                raise _Refused("no_room", "no room: the conversations that would have to go are in use")
            idx.reserve(keys[:have], _RESERVED)
            for cid in victims:
                self._evict_ram(cid)
        new_blocks: list[Block] = []
        tail = None
        try:
            for i in range(have, len(keys)):
                kv = self._check_kv(read_kv(i * b, (i + 1) * b), b)
                new_blocks.append(Block(keys[i], kv.nbytes, tensor=kv))
            if n_tail:
                tail = self._check_kv(read_kv(len(keys) * b, len(toks)), n_tail)
        except _Refused:
            with self._lock:
                idx.release(keys[:have], _RESERVED)
            raise
        except Exception as exc:
            with self._lock:
                idx.release(keys[:have], _RESERVED)
            log.exception("conversation cache: reading the slot's K/V failed")
            raise _Refused("read_error", f"reading the slot's K/V failed: {exc}") from None
        with self._lock:
            conv_id, created, hits = self._inherit(superseded)
            for old in superseded:
                idx.remove(old.id)
                if old.id != conv_id:
                    self._redirect(old.id, conv_id)
            now = time.time()
            conv = Conv(conv_id, toks, keys, own, tail=tail, created=created, last_used=now, hits=hits)
            idx.add(conv, new_blocks)
            idx.release(keys[:have], _RESERVED)
        new_bytes = sum(blk.nbytes for blk in new_blocks) + (tail.nbytes if tail is not None else 0)
        return conv, new_bytes, len(victims)

    def _evict_ram(self, conv_id: str, *, spill: bool = True, reason: str = "evict") -> int:
        """Drop a RAM conversation (tiered: hand it to the disk writer); returns the RAM bytes freed."""
        idx = self._ram
        conv = idx.convs[conv_id]
        tensors = {k: idx.blocks[k].tensor for k in conv.keys}
        before = idx.bytes
        idx.remove(conv_id)
        freed = before - idx.bytes
        if reason == "evict":
            self._c["evictions"] += 1
        self._event(reason, conv_id, conv.n_tokens, freed, 0.0, "ram")
        if spill and self.settings.storage == "tiered" and self._disk is not None and not self._disk.error:
            self._queue_spill(conv, tensors)
        return freed

    def _park_disk(
        self, toks: np.ndarray, keys: list[str], read_kv: ReadKV, keep: str | None, *, background: bool = True
    ):
        """Park a conversation on disk (disk mode, tiered fallback).

        With `background` (disk mode), the new blocks and the tail are captured into host memory and handed to
        the writer: the park returns without waiting on the disk, the entry is served from that RAM copy until
        written, and the RAM held by pending writes never exceeds `spill_queue_bytes` (the oldest pending write
        is dropped and counted to make room). A park that cannot fit the staging bound even then (or without
        `background`) streams its blocks to files and publishes its manifest before returning.
        """
        disk, s, b = self._disk, self.settings, self.identity.block_tokens
        if disk is None or disk.error or not s.uses_disk:
            raise _Refused("disk_unavailable", disk.error if disk and disk.error else "no disk tier")
        idx = disk.index
        with self._lock:
            candidates = [c for c in idx.prefixes_of(toks) if not c.failed]
            superseded = [c for c in candidates if not idx.is_pinned(c)]
            same = [c for c in candidates if c.n_tokens == len(toks)]  # parked (written or on its way)
            if same:
                same[0].last_used = time.time()
                idx.touch(same[0].id)
                if same[0].on_disk:
                    disk.touch(same[0])
                return same[0], 0, 0
            have = idx.matched_blocks(keys)
            n_tail = len(toks) - len(keys) * b
            manifest = disk.manifest_size(len(toks))
            need = (len(keys) - have) * disk.block_size() + manifest
            total = len(keys) * disk.block_size() + manifest
            if total > s.disk_bytes:
                raise _Refused(
                    "larger_than_budget",
                    f"{total / MIB:.1f} MiB conversation is larger than the whole disk budget ({s.disk_bytes / MIB:.0f} MiB)",
                )
            victims = idx.plan_room(
                need_bytes=need,
                budget=s.disk_bytes,
                slots=s.slots,
                keep_keys=set(keys),
                leaving={c.id for c in candidates},
                exclude={keep} if keep else set(),
                in_flight_ok=True,  # only the writer pins entries while the engine thread parks
            )
            if victims is None:
                raise _Refused(
                    "no_room", "no room on disk: the conversations that would have to go are in use"
                )
            idx.reserve(keys[:have], _RESERVED)
            staged = (
                len(keys) - have
            ) * self.identity.block_bytes + n_tail * self.identity.layout.bytes_per_token
            protect = {c.id for c in candidates} | set(victims) | ({keep} if keep else set())
            background = background and self._writer is not None and self._make_staging_room(staged, protect)
            if not background:
                # blocks indexed but still waiting for the writer are written here too: a published manifest
                # only ever names published block files
                pending = [(k, idx.blocks[k].tensor) for k in keys[:have] if not idx.blocks[k].on_disk]
                for k, _ in pending:
                    idx.blocks[k].pins += 1
            # a staged entry continues its line's id even while that line's last version is being written
            conv_id, created, hits = self._inherit(candidates if background else superseded)
        if background:
            plan = (toks, keys, have, n_tail, candidates, victims, conv_id, created, hits)
            return self._stage_disk(read_kv, plan)
        plan = (toks, keys, have, n_tail, superseded, victims, conv_id, created, hits)
        return self._write_disk_now(read_kv, plan, pending)

    def _stage_disk(self, read_kv: ReadKV, plan):
        """Capture a park's new K/V into host memory and queue its write; the entry is restorable at once."""
        toks, keys, have, n_tail, superseded, victims, conv_id, created, hits = plan
        disk, b = self._disk, self.identity.block_tokens
        idx = disk.index
        new_blocks: list[Block] = []
        tail = None
        try:
            for i in range(have, len(keys)):
                kv = self._check_kv(read_kv(i * b, (i + 1) * b), b)
                new_blocks.append(Block(keys[i], disk.block_size(), tensor=kv))
            if n_tail:
                tail = self._check_kv(read_kv(len(keys) * b, len(toks)), n_tail)
        except Exception as exc:
            with self._lock:
                idx.release(keys[:have], _RESERVED)
            if isinstance(exc, _Refused):
                raise
            log.exception("conversation cache: reading the slot's K/V failed")
            raise _Refused("read_error", f"reading the slot's K/V failed: {exc}") from None
        with self._lock:
            for cid in victims:
                if cid in idx.convs:
                    self._evict_disk(cid)
            previous = None
            later: list[str] = []
            for old in superseded:
                if idx.convs.get(old.id) is not old:
                    continue
                if old.id == conv_id:
                    # the same conversation line: this entry takes its place. The version written (or being
                    # written) stays the file on disk, and comes back on a failed write, until this one's
                    # manifest replaces it; a version only queued is superseded before it was ever written.
                    previous = old if old.on_disk or old.pins else old.previous
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
                disk.manifest_size(len(toks)),
                tail=tail,
                created=created,
                last_used=time.time(),
                hits=hits,
                supersedes=later,
                previous=previous,
            )
            idx.add(conv, new_blocks)
            idx.release(keys[:have], _RESERVED)
            assert self._writer is not None
            self._writer.submit(conv_id)
        new_bytes = sum(blk.tensor.nbytes for blk in new_blocks) + (tail.nbytes if tail is not None else 0)
        return conv, new_bytes, len(victims)

    def _make_staging_room(self, nbytes: int, protect: set[str]) -> bool:
        """Make `nbytes` more fit the staging bound by dropping the oldest pending writes (counted); caller holds
        the lock. False, with nothing dropped, when even dropping every droppable one would not be enough."""
        bound = self.settings.spill_queue_bytes
        if nbytes > bound:
            return False
        idx = self._disk.index
        over = self._pending_bytes() + nbytes - bound
        gone: set[str] = set()
        freed_keys: set[str] = set()
        plan: list[Conv] = []
        for conv in list(idx.convs.values()):
            if over <= 0:
                break
            if conv.on_disk or conv.id in protect or idx.is_pinned(conv):
                continue
            plan.append(conv)
            gone.add(conv.id)
            over -= conv.tail.nbytes if conv.tail is not None else 0
            for k in conv.keys:
                blk = idx.blocks[k]
                if k not in freed_keys and blk.tensor is not None and not blk.on_disk and blk.holders <= gone:
                    freed_keys.add(k)
                    over -= blk.tensor.nbytes
        if over > 0:
            return False
        for conv in plan:
            self._c["spill_dropped"] += 1
            log.warning(
                "conversation cache: disk write queue full; dropped pending write of %s (%d tokens)",
                conv.id,
                conv.n_tokens,
            )
            self._drop_pending(conv, "spill_drop")
        return True

    def _drop_pending(self, conv: Conv, reason: str) -> None:
        """Remove a pending (unwritten) disk entry; the written version it replaced, if any, comes back."""
        idx = self._disk.index
        prev = conv.previous
        if prev is None:
            self._remove_disk(conv.id, reason=reason)
            return
        token = "\x00previous"
        idx.reserve(prev.keys, token)  # its blocks outlive the pending entry that held them
        conv.previous = None
        self._remove_disk(conv.id, reason=reason)
        if prev.id not in idx.convs:
            idx.add(prev, [])
        idx.release(prev.keys, token)

    def _write_disk_now(self, read_kv: ReadKV, plan, pending):
        """Write a conversation's new blocks and its manifest before returning."""
        toks, keys, have, n_tail, superseded, victims, conv_id, created, hits = plan
        disk, b = self._disk, self.identity.block_tokens
        idx = disk.index

        def capture(i: int):
            return lambda: self._check_kv(read_kv(i * b, (i + 1) * b), b)

        written: dict[str, int] = {}
        try:
            items = [(k, t) for k, t in pending if t is not None]
            items += [(keys[i], capture(i)) for i in range(have, len(keys))]
            written = disk.write_blocks(items)
            tail = self._check_kv(read_kv(len(keys) * b, len(toks)), n_tail) if n_tail else None
            conv = Conv(conv_id, toks, keys, 0, created=created, last_used=time.time(), hits=hits)
            conv.nbytes = disk.write_manifest(conv, tail)
            conv.on_disk = True
        except Exception as exc:
            with self._lock:
                for k, _ in pending:
                    idx.blocks[k].pins -= 1
                idx.release(keys[:have], _RESERVED)
                for k in written:
                    if k not in idx.blocks:
                        disk.delete_conv(Conv("", toks[:0], [], 0), [Block(k, 0, on_disk=True)])
            if isinstance(exc, _Refused):
                raise
            if isinstance(exc, OSError):
                raise _Refused(
                    "disk_error",
                    f"writing to {disk.folder} failed: {exc.strerror or exc}; nothing on disk was lost",
                ) from None
            log.exception("conversation cache: parking to disk failed")
            raise _Refused("read_error", f"parking to disk failed: {exc}") from None
        with self._lock:
            for k, _ in pending:
                blk = idx.blocks[k]
                blk.pins -= 1
                if k in written:
                    self._mark_block_written(idx, blk, written[k])
            new_blocks = [Block(keys[i], written[keys[i]], on_disk=True) for i in range(have, len(keys))]
            for old in superseded:
                if old.id not in idx.convs or idx.convs[old.id] is not old or idx.is_pinned(old):
                    continue
                if old.id == conv_id:
                    idx.remove(old.id)  # its manifest file was just replaced by the new one
                else:
                    self._remove_disk(old.id)
                    self._redirect(old.id, conv_id)
            idx.add(conv, new_blocks)
            idx.release(keys[:have], _RESERVED)
            for cid in victims:
                if cid in idx.convs:
                    self._evict_disk(cid)
        new_bytes = sum(written.values()) + conv.nbytes
        return conv, new_bytes, len(victims)

    def _evict_disk(self, conv_id: str) -> None:
        """Evict a disk entry; one being written leaves the index now and its files once the writer is done."""
        idx = self._disk.index
        conv = idx.convs[conv_id]
        for c in (conv, conv.previous):
            if c is not None and c.pins:
                self._orphans.add(c)
        if conv.previous is not None and conv.previous.pins:
            conv.previous = None  # its manifest is being published: removed by _reap, not now
        self._remove_disk(conv_id, reason="evict")

    def _remove_orphan(self, written: Conv) -> None:
        """Remove the files a write published for an entry evicted meanwhile (caller holds the lock)."""
        disk = self._disk
        idx = disk.index
        if written.on_disk and written.id not in idx.convs:
            disk.delete_conv(written, [])
        disk.delete_conv(
            Conv("", written.tokens[:0], [], 0),
            [Block(k, 0, on_disk=True) for k in written.keys if k not in idx.blocks],
        )

    def _mark_block_written(self, idx: TierIndex, blk: Block, size: int) -> None:
        blk.on_disk = True
        blk.tensor = None
        idx.bytes += size - blk.nbytes
        blk.nbytes = size

    def _remove_disk(self, conv_id: str, *, reason: str = "") -> int:
        """Drop a disk conversation and the files no one else needs; returns the bytes freed."""
        disk = self._disk
        assert disk is not None
        before = disk.index.bytes
        conv, freed = disk.index.remove(conv_id)
        disk.delete_conv(conv, freed)
        if conv.previous is not None and not conv.on_disk:
            disk.delete_conv(conv.previous, [])  # the written version it was to replace goes too
            conv.previous = None
        if self._writer is not None:
            self._writer.forget(conv_id)
        if reason:
            if reason == "evict":
                self._c["evictions"] += 1
            self._event(reason, conv_id, conv.n_tokens, before - disk.index.bytes, 0.0, "disk")
        return before - disk.index.bytes

    def _redirect(self, old: str, new: str) -> None:
        self._redirects[old] = new
        while len(self._redirects) > 4096:
            self._redirects.popitem(last=False)

    # ------------------------------------------------------------------ tiered spills

    def _queue_spill(
        self, conv: Conv, tensors: dict[str, torch.Tensor | None], *, bounded: bool = True
    ) -> bool:
        """Index a RAM-evicted conversation on disk as pending and queue its write. Caller holds the lock."""
        disk, s = self._disk, self.settings
        assert disk is not None
        idx = disk.index
        superseded = [c for c in idx.prefixes_of(conv.tokens) if not c.failed]
        if any(c.n_tokens == conv.n_tokens for c in superseded):
            return True  # already on disk (or on its way)
        have = idx.matched_blocks(conv.keys)
        manifest = disk.manifest_size(conv.n_tokens)
        need = (len(conv.keys) - have) * disk.block_size() + manifest
        total = len(conv.keys) * disk.block_size() + manifest
        victims = None
        if total <= s.disk_bytes:
            victims = idx.plan_room(
                need_bytes=need,
                budget=s.disk_bytes,
                slots=s.slots,
                keep_keys=set(conv.keys),
                leaving={c.id for c in superseded},
                exclude=set(),
            )
        if victims is None:
            self._c["spill_dropped"] += 1
            self._event("spill_drop", conv.id, conv.n_tokens, 0, 0.0, "disk", reason="no room on disk")
            log.warning(
                "conversation cache: no room on disk for %s (%d tokens); dropped", conv.id, conv.n_tokens
            )
            return False
        # Hold the blocks this spill reuses: evicting a victim that shares them must not free them.
        idx.reserve(conv.keys[:have], _RESERVED)
        for cid in victims:
            self._drop_disk_entry(cid, "evict")
        conv_id = conv.id if conv.id not in idx.convs else secrets.token_hex(8)
        new_blocks = [Block(k, disk.block_size(), tensor=tensors[k]) for k in conv.keys[have:]]
        pconv = Conv(
            conv_id,
            conv.tokens,
            list(conv.keys),
            manifest,
            tail=conv.tail,
            created=conv.created,
            last_used=conv.last_used,
            hits=conv.hits,
            supersedes=[c.id for c in superseded],
        )
        idx.add(pconv, new_blocks)
        idx.release(conv.keys[:have], _RESERVED)  # the new entry holds them now
        assert self._writer is not None
        self._writer.submit(conv_id)
        if bounded:
            self._bound_spill_queue(keep=conv_id)
        return True

    def _drop_disk_entry(self, conv_id: str, reason: str) -> None:
        """Remove a disk entry, written or pending (pinned entries are never passed here)."""
        self._remove_disk(conv_id, reason=reason)

    def _pending_bytes(self) -> int:
        if self._disk is None:
            return 0
        idx = self._disk.index
        total = sum(b.tensor.nbytes for b in idx.blocks.values() if b.tensor is not None and not b.on_disk)
        return total + sum(c.tail.nbytes for c in idx.convs.values() if c.tail is not None and not c.on_disk)

    def _bound_spill_queue(self, keep: str) -> None:
        """Drop the oldest pending spills while the RAM they hold exceeds the spill-queue bound."""
        assert self._disk is not None and self._writer is not None
        idx = self._disk.index
        while self._pending_bytes() > self.settings.spill_queue_bytes:
            victim = next(
                (c for c in idx.convs.values() if not c.on_disk and c.id != keep and not idx.is_pinned(c)),
                None,
            )
            if victim is None:
                return
            self._c["spill_dropped"] += 1
            log.warning("conversation cache: spill queue full; dropped pending spill of %s", victim.id)
            self._remove_disk(victim.id, reason="spill_drop")

    def _start_writer(self) -> None:
        if self._writer is None and self._disk is not None:
            self._writer = _SpillWriter(self)
            self._writer.start()

    def _stop_writer(self, deadline: float) -> bool:
        """Let the writer finish what is queued until `deadline` (monotonic); True when everything was written."""
        if self._writer is None:
            return True
        done = self._writer.drain(deadline)
        self._writer.stop(deadline)
        with self._lock:
            self._reap()
            self._writer = None
        return done

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait up to `timeout` seconds for every pending disk write (disk-mode parks, tiered spills) to land.

        True when nothing is left pending and no write failed meanwhile (failures are counted in
        `spill_failed` and logged; the entry is dropped and any version of it already on disk is kept).
        """
        writer = self._writer
        with self._lock:
            failed = self._c["spill_failed"]
        done = writer.drain(time.monotonic() + max(timeout, 0.0)) if writer is not None else True
        with self._lock:
            self._reap()
            left = self._disk is not None and any(not c.on_disk for c in self._disk.index.convs.values())
            return done and not left and self._c["spill_failed"] == failed

    def _reap(self) -> None:
        """Apply what the writer reported: drop superseded entries of finished spills, failed spills."""
        if self._writer is None or self._disk is None:
            return
        idx = self._disk.index
        for kind, written, message in self._writer.take_results():
            if written in self._orphans:
                self._orphans.discard(written)
                self._remove_orphan(written)
                continue
            conv_id = written.id
            conv = idx.convs.get(conv_id)
            if conv is not written:
                # removed, or replaced by a newer version of its line that keeps it as the version on disk
                if kind == "failed" and conv is not None and conv.previous is written:
                    conv.previous = written.previous  # the one before it is still the file on disk
                    written.previous = None
                    self._c["spill_failed"] += 1
                    log.warning(
                        "conversation cache: writing %s to disk failed (%s); its newer version is pending",
                        conv_id,
                        message,
                    )
                continue
            if kind == "done":
                for old in conv.supersedes:
                    if old in idx.convs and old != conv_id and not idx.is_pinned(idx.convs[old]):
                        self._remove_disk(old)
                        self._redirect(old, conv_id)
                conv.supersedes = []
            elif idx.is_pinned(conv):
                self._writer.results.append((kind, written, message))  # dropped once its reader is done
            else:
                self._c["spill_failed"] += 1
                log.warning(
                    "conversation cache: writing %s to disk failed (%s); dropped%s; nothing already on disk was lost",
                    conv_id,
                    message,
                    ", its previously written version is kept" if conv.previous is not None else "",
                )
                self._drop_pending(conv, "spill_failed")

    # ------------------------------------------------------------------ restore

    def restore(self, hit: CacheHit, write_kv: WriteKV) -> RestoreResult:
        """Validate and gather the hit's K/V in host memory, then `write_kv(start, kv)` for [0, hit.n_tokens).

        Raises CacheRestoreError before the first `write_kv` when anything is wrong; exceptions of `write_kv`
        itself propagate (the engine then clears the slot).
        """
        t0 = time.perf_counter()
        b = self.identity.block_tokens
        with self._lock:
            self._reap()
            if hit.identity_key and hit.identity_key != self.identity.key:
                self._c["restore_failures"] += 1
                raise CacheRestoreError("the hit was made for another model identity; prefill instead")
            found = self._find(hit)
            if found is None:
                self._c["restore_failures"] += 1
                raise CacheRestoreError(
                    f"conversation {hit.conversation_id} is no longer parked; prefill instead"
                )
            tier, conv = found
            n = hit.n_tokens
            if not 0 < n <= conv.n_tokens:
                self._c["restore_failures"] += 1
                raise CacheRestoreError(
                    f"hit of {n} tokens does not fit conversation {conv.id} ({conv.n_tokens})"
                )
            n_full = min(len(conv.keys), math.ceil(n / b))
            use_tail = n > len(conv.keys) * b
            index = self._ram if tier == "ram" else self._disk.index
            blocks = [index.blocks[k] for k in conv.keys[:n_full]]
            if tier == "disk":
                conv.pins += 1
                for blk in blocks:
                    blk.pins += 1
        try:
            pieces, read_bytes = self._gather(tier, conv, blocks, use_tail)
        except CacheRestoreError:
            with self._lock:
                self._c["restore_failures"] += 1
            raise
        finally:
            if tier == "disk":
                with self._lock:
                    conv.pins -= 1
                    for blk in blocks:
                        blk.pins -= 1
        for start, kv in pieces:
            if start >= n:
                break
            take = min(kv.shape[2], n - start)
            write_kv(start, kv if take == kv.shape[2] else kv[:, :, :take])
        ms = (time.perf_counter() - t0) * 1000
        nbytes = n * self.identity.layout.bytes_per_token
        with self._lock:
            now = time.time()
            conv.hits += 1
            conv.last_used = now
            if conv.id in index.convs:
                index.touch(conv.id)
            if tier == "disk" and self._disk is not None and conv.on_disk:
                self._disk.touch(conv)
            self._c["restores"] += 1
            self._c["hits"] += 1
            self._c["tokens_reused"] += n
            self._c["bytes_restored"] += nbytes
            self._restore_ms.add(ms)
            if ms > 0:
                measured = read_bytes / (ms / 1000)
                self._bandwidth[tier] = (
                    measured if self._restore_ms.count == 1 else 0.7 * self._bandwidth[tier] + 0.3 * measured
                )
            self._event("restore", conv.id, n, nbytes, ms, tier)
        log.info(
            "conversation cache: restored %s from %s: %d tokens, %.1f MiB, %.1f ms",
            conv.id,
            tier,
            n,
            nbytes / MIB,
            ms,
        )
        return RestoreResult(n, nbytes, ms, tier)

    def _find(self, hit: CacheHit) -> tuple[str, Conv] | None:
        conv_id = hit.conversation_id
        for _ in range(16):
            tiers = sorted(self._tiers(), key=lambda t: t[0] != hit.tier)
            for tier, index in tiers:
                conv = index.convs.get(conv_id)
                if conv is not None and not conv.failed and conv.n_tokens >= hit.n_tokens:
                    return tier, conv
            if conv_id not in self._redirects:
                return None
            conv_id = self._redirects[conv_id]
        return None

    def _gather(self, tier: str, conv: Conv, blocks: list[Block], use_tail: bool):
        """(start, host K/V) pieces of the conversation, all validated; raises CacheRestoreError."""
        layout, b = self.identity.layout, self.identity.block_tokens
        pieces: list[tuple[int, torch.Tensor]] = []
        read = 0
        try:
            for i, blk in enumerate(blocks):
                kv = blk.tensor
                if kv is None:
                    if tier != "disk":
                        raise CacheRestoreError(f"block {blk.key[:12]} of {conv.id} has no data")
                    kv = self._disk.read_block(blk.key)
                pieces.append((i * b, kv))
                read += kv.nbytes
            if use_tail:
                tail = conv.tail
                if tail is None:
                    if tier != "disk":
                        raise CacheRestoreError(f"conversation {conv.id} has no tail data")
                    tail = self._disk.read_tail(conv)
                    if tail is None:
                        raise FileFormatError("corrupt", "manifest has no K/V for the partial block")
                pieces.append((len(conv.keys) * b, tail))
                read += tail.nbytes
        except (FileFormatError, OSError) as exc:
            message = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            log.warning(
                "conversation cache: conversation %s cannot be restored (%s); removing it", conv.id, message
            )
            with self._lock:
                self._drop_broken(conv, blocks)
            raise CacheRestoreError(
                f"parked conversation {conv.id} is damaged ({message}); prefill instead"
            ) from None
        for start, kv in pieces:
            n = kv.shape[2]
            if (
                tuple(kv.shape) != layout.host_shape(n)
                or kv.dtype != layout.dtype
                or (start < len(conv.keys) * b and n != b)
            ):
                raise CacheRestoreError(f"conversation {conv.id}: stored K/V has the wrong shape or dtype")
        return pieces, read

    def _drop_broken(self, conv: Conv, blocks: list[Block]) -> None:
        """Remove a damaged disk conversation and every conversation sharing a damaged block."""
        disk = self._disk
        if disk is None:
            return
        idx = disk.index
        conv.pins -= 1
        for blk in blocks:
            blk.pins -= 1
        try:
            bad = set()
            for blk in blocks:
                if blk.on_disk and blk.tensor is None:
                    try:
                        disk.read_block(blk.key)
                    except (FileFormatError, OSError):
                        bad.add(blk.key)
            victims = {conv.id} | {c.id for c in idx.convs.values() if bad & set(c.keys)}
            for cid in victims:
                if cid in idx.convs and not idx.is_pinned(idx.convs[cid]):
                    self._remove_disk(cid, reason="corrupt")
        finally:
            conv.pins += 1
            for blk in blocks:
                blk.pins += 1

    # ------------------------------------------------------------------ purge, listing, stats

    def purge(self, tier: str) -> PurgeResult:
        """Drop every parked conversation of `tier` ("ram", "disk" or "all"); in-flight entries are skipped."""
        if tier not in ("ram", "disk", "all"):
            raise ValueError(f"tier: expected ram, disk or all, got {tier!r}")
        dropped, freed, skipped = 0, 0, []
        with self._lock:
            self._reap()
            if tier in ("ram", "all"):
                for cid in list(self._ram.convs):
                    freed += self._evict_ram(cid, spill=False, reason="purge")
                    dropped += 1
            if tier in ("disk", "all") and self._disk is not None:
                idx = self._disk.index
                for cid in list(idx.convs):
                    conv = idx.convs[cid]
                    if idx.is_pinned(conv):
                        skipped.append((cid, "being written to or read from disk"))
                        continue
                    freed += self._remove_disk(cid, reason="purge")
                    dropped += 1
        log.info(
            "conversation cache: purged %s: %d conversations, %.1f MiB; %d skipped",
            tier,
            dropped,
            freed / MIB,
            len(skipped),
        )
        return PurgeResult(dropped, freed, skipped, tier)

    def conversations(self) -> list[ConversationInfo]:
        """Every parked conversation, most recently used first."""
        with self._lock:
            rows = []
            for tier, index in self._tiers():
                for conv in index.convs.values():
                    rows.append(
                        ConversationInfo(
                            conv.id,
                            conv.n_tokens,
                            index.conv_bytes(conv),
                            tier,
                            conv.created,
                            conv.last_used,
                            conv.hits,
                            pending=tier == "disk" and not conv.on_disk,
                        )
                    )
        return sorted(rows, key=lambda r: r.last_used, reverse=True)

    def stats(self) -> CacheStats:
        with self._lock:
            s = self.settings
            disk = self._disk
            return CacheStats(
                enabled=s.enabled,
                storage=s.storage,
                dir=disk.folder if disk else s.dir,
                ram_bytes=s.ram_bytes,
                disk_bytes=s.disk_bytes,
                slots=s.slots,
                min_free_bytes=s.min_free_bytes,
                block_tokens=self.identity.block_tokens,
                bytes_ram=self._ram.bytes,
                bytes_disk=disk.index.bytes if disk else 0,
                bytes_pending=self._pending_bytes(),
                entries_ram=len(self._ram.convs),
                entries_disk=len(disk.index.convs) if disk else 0,
                blocks_ram=len(self._ram.blocks),
                blocks_disk=len(disk.index.blocks) if disk else 0,
                refusals=dict(self._refusals),
                declined=dict(self._declined),
                park_ms=self._park_ms.summary(),
                restore_ms=self._restore_ms.summary(),
                restore_bandwidth=dict(self._bandwidth),
                prefill_tokens_per_s=self.prefill_tokens_per_s,
                disk_error=disk.error if disk else "",
                **self._c,
            )

    def events(self, limit: int = 200) -> list[dict]:
        """The most recent park/restore/evict/spill/refuse events, oldest first."""
        with self._lock:
            return list(self._events)[-limit:] if limit > 0 else []

    def _event(self, kind: str, conv_id: str | None, tokens: int, nbytes: int, ms: float, tier: str, **extra):
        self._events.append(
            {
                "time": time.time(),
                "kind": kind,
                "conversation_id": conv_id,
                "tokens": tokens,
                "bytes": nbytes,
                "ms": round(ms, 3),
                "tier": tier,
                **extra,
            }
        )

    def _tiers(self) -> list[tuple[str, TierIndex]]:
        tiers = [("ram", self._ram)]
        if self._disk is not None:
            tiers.append(("disk", self._disk.index))
        return tiers

    # ------------------------------------------------------------------ budgets, expiry, reconfigure, close

    def _enforce_budgets(self) -> None:
        """Evict LRU conversations until every tier is within its budget and slot count."""
        s = self.settings
        with self._lock:
            ram_budget = s.ram_bytes if s.uses_ram else 0
            for cid in list(self._ram.convs):
                if self._ram.bytes <= ram_budget and len(self._ram.convs) <= (s.slots if s.uses_ram else 0):
                    break
                self._evict_ram(cid)
            if self._disk is not None:
                idx = self._disk.index
                for cid in list(idx.convs):
                    if idx.bytes <= s.disk_bytes and len(idx.convs) <= s.slots:
                        break
                    if cid in idx.convs and not idx.is_pinned(idx.convs[cid]):
                        self._remove_disk(cid, reason="evict")

    def _expire_if_due(self) -> None:
        now = time.time()
        if self._disk is None or now < self._next_expiry or self.settings.days <= 0:
            return
        self._next_expiry = now + 60
        idx = self._disk.index
        for cid, conv in list(idx.convs.items()):
            if conv.on_disk and now - conv.last_used > self.settings.days * DAY and not idx.is_pinned(conv):
                self._remove_disk(cid, reason="expire")

    def _open_disk(self, parent: str, days: float) -> DiskTier:
        disk = DiskTier(parent, self.identity, engine_version=self.engine_version)
        disk.open(days=days)
        return disk

    def reconfigure(self, settings: CacheSettings) -> list[str]:
        """Apply new settings live; returns the names that changed. Nothing parked is lost unless budgets shrink.

        Raises ValueError for a change that cannot be made live and CacheDirLockedError for a folder another
        engine holds; in both cases nothing changed.
        """
        old = self.settings
        changed = [
            f.name
            for f in dataclasses.fields(CacheSettings)
            if getattr(old, f.name) != getattr(settings, f.name)
        ]
        if not changed:
            return []
        if settings.block_tokens != old.block_tokens:
            raise ValueError("block_tokens cannot change on a running engine; restart with the new value")
        wants_disk = settings.uses_disk
        new_disk = None
        if wants_disk and (self._disk is None or settings.dir != old.dir):
            new_disk = self._open_disk(settings.dir, settings.days)  # may raise: nothing changed yet
        if self._disk is not None and (new_disk is not None or not wants_disk):
            self._stop_writer(time.monotonic() + 600)
            with self._lock:
                if new_disk is not None:
                    self._move_disk(self._disk, new_disk)
                else:
                    log.info(
                        "conversation cache: %d conversations stay in %s until disk storage is used again",
                        len(self._disk.index.convs),
                        self._disk.folder,
                    )
                self._disk.close()
                self._disk = None
        with self._lock:
            self.settings = settings
            if new_disk is not None:
                self._disk = new_disk
        self._start_writer()
        if self._ram.convs and (not settings.uses_ram) and self._disk is not None:
            # ram -> disk: every RAM conversation is written before the change returns
            with self._lock:
                for cid in list(self._ram.convs):
                    conv = self._ram.convs[cid]
                    tensors = {k: self._ram.blocks[k].tensor for k in conv.keys}
                    self._ram.remove(cid)
                    self._queue_spill(conv, tensors, bounded=False)
            self._writer.drain(time.monotonic() + 600)
            with self._lock:
                self._reap()
        self._enforce_budgets()
        log.info("conversation cache: reconfigured %s", ", ".join(changed))
        return changed

    def _move_disk(self, old: DiskTier, new: DiskTier) -> None:
        """Copy every conversation of `old` into `new` (verified reads, atomic writes), then remove it from `old`."""
        for cid in list(old.index.convs):
            conv = old.index.convs[cid]
            if cid in new.index.convs:
                continue
            try:
                missing = [k for k in conv.keys if k not in new.index.blocks]
                sizes = new.write_blocks([(k, (lambda k=k: old.read_block(k))) for k in missing])
                tail = old.read_tail(conv) if conv.n_tokens % self.identity.block_tokens else None
                copy = Conv(
                    cid,
                    conv.tokens,
                    conv.keys,
                    0,
                    created=conv.created,
                    last_used=conv.last_used,
                    hits=conv.hits,
                )
                copy.nbytes = new.write_manifest(copy, tail)
                copy.on_disk = True
            except (OSError, FileFormatError) as exc:
                log.warning("conversation cache: could not move %s to %s: %s", cid, new.folder, exc)
                continue
            new.index.add(copy, [Block(k, sizes[k], on_disk=True) for k in missing])
            c, freed = old.index.remove(cid)
            old.delete_conv(c, freed)

    def close(self, *, spill: bool, deadline_s: float = 30.0) -> None:
        """Stop the cache. Tiered with `spill`: write everything parked to disk within the deadline (logged if hit)."""
        deadline = time.monotonic() + deadline_s
        with self._lock:
            self._reap()
            if (
                spill
                and self.settings.storage == "tiered"
                and self._disk is not None
                and self._writer is not None
            ):
                for cid in reversed(list(self._ram.convs)):  # most recently used first
                    conv = self._ram.convs[cid]
                    tensors = {k: self._ram.blocks[k].tensor for k in conv.keys}
                    self._queue_spill(conv, tensors, bounded=False)
        complete = self._stop_writer(deadline)
        if not complete:
            with self._lock:
                left = sum(1 for c in self._disk.index.convs.values() if not c.on_disk) if self._disk else 0
            log.warning(
                "conversation cache: shutdown deadline of %.0f s hit; %d conversations not written",
                deadline_s,
                left,
            )
        with self._lock:
            if self._disk is not None:
                self._disk.close()


class _SpillWriter(threading.Thread):
    """Writes pending disk entries (RAM-evicted conversations) one at a time, oldest first."""

    def __init__(self, cache: ConversationCache) -> None:
        super().__init__(name="strata-cache-writer", daemon=True)
        self.cache = cache
        self.cond = threading.Condition(cache._lock)
        self.queue: deque[str] = deque()
        self.results: list[tuple[str, Conv, str]] = []
        self.busy = False
        self.stopping = False

    def submit(self, conv_id: str) -> None:
        with self.cond:
            self.queue.append(conv_id)
            self.cond.notify_all()

    def forget(self, conv_id: str) -> None:
        with self.cond, contextlib.suppress(ValueError):
            self.queue.remove(conv_id)

    def take_results(self) -> list[tuple[str, Conv, str]]:
        with self.cond:
            out, self.results = self.results, []
            return out

    def drain(self, deadline: float) -> bool:
        with self.cond:
            while self.queue or self.busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(min(left, 0.5))
            return True

    def stop(self, deadline: float) -> None:
        with self.cond:
            self.stopping = True
            self.queue.clear()
            self.cond.notify_all()
        self.join(timeout=max(deadline - time.monotonic(), 0) + 1)

    def run(self) -> None:
        cache = self.cache
        while True:
            with self.cond:
                while not self.queue and not self.stopping:
                    self.cond.wait()
                if self.stopping:
                    return
                disk = cache._disk
                conv_id = self.queue.popleft()
                conv = disk.index.convs.get(conv_id) if disk else None
                if conv is None or conv.on_disk:
                    continue
                self.busy = True
                conv.pins += 1
                blocks = [disk.index.blocks[k] for k in conv.keys if not disk.index.blocks[k].on_disk]
                for blk in blocks:
                    blk.pins += 1
                items = [(blk.key, blk.tensor) for blk in blocks]
                tail = conv.tail
            t0 = time.perf_counter()
            error = ""
            sizes: dict[str, int] = {}
            manifest = 0
            try:
                if any(t is None for _, t in items):
                    raise RuntimeError("a pending block lost its RAM copy")
                sizes = disk.write_blocks(items)
                manifest = disk.write_manifest(conv, tail)
            except (
                Exception
            ) as exc:  # disk full, read-only folder, ...: the spill is dropped, never the engine
                error = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            ms = (time.perf_counter() - t0) * 1000
            with self.cond:
                idx = disk.index
                for blk in blocks:
                    blk.pins -= 1
                    if blk.key in sizes and blk.key in idx.blocks:
                        cache._mark_block_written(idx, blk, sizes[blk.key])
                conv.pins -= 1
                if error:
                    conv.failed = error
                    self.results.append(("failed", conv, error))
                else:
                    conv.on_disk = True
                    conv.tail = None
                    conv.previous = None  # its manifest replaced the previous version's
                    if idx.convs.get(conv.id) is conv:
                        idx.bytes += manifest - conv.nbytes
                    conv.nbytes = manifest
                    written = sum(sizes.values()) + manifest
                    cache._c["spills"] += 1
                    cache._c["bytes_spilled"] += written
                    cache._event("spill", conv.id, conv.n_tokens, written, ms, "disk")
                    self.results.append(("done", conv, ""))
                self.busy = False
                self.cond.notify_all()
