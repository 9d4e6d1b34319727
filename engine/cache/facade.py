"""The conversation cache: park a slot's K/V, find the longest reusable prefix, restore it, under budgets.

`ConversationCache` is the one interface the runtime and the server use (`CacheAPI` in engine.cache.api). It
owns the settings, the lock and the journal (counters, events), and routes each call to the tier that owns
the state: `RamTier` (ram_tier.py) and `DiskStore` (disk_store.py, with its files in disk_tier.py and its
background `DiskWriter`). Three modes:
- ram: blocks live in RAM; evicted conversations are dropped.
- disk: a park captures the slot's new K/V into host memory and queues it for the background writer, then
  returns: a switch never waits on the disk. Until written, the entry is served from that RAM copy; once
  written, RAM keeps only the index. The RAM held by pending writes is bounded by `spill_queue_bytes` (the
  oldest pending write is dropped and counted to make room; a park bigger than the bound alone is written to
  its files before returning). A failed write is counted (`spill_failed`) and logged, and loses nothing that
  was already on disk: a re-park's previous written version stays the file on disk until replaced.
- tiered: parks go to RAM; what RAM evicts is queued for the same background writer (served from its RAM copy
  until written, under the same bound); `close(spill=True)` writes everything parked.
With `remote_url`, parks are also written through to a shared store (`RemoteTier`, engine/cache/remote/), and a
lookup that the local tiers cannot serve in full asks it for the longest stored prefix.
Threads: the engine thread is the only caller of mutating methods; `stats`, `conversations` and `events` may
be called from any thread; the writer thread only writes files and reports under the same lock. What it
reports is applied by the engine thread (`DiskStore.reap`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Mapping, Sequence

from engine.cache import reconfigure, restores, views
from engine.cache.attrs import NO_ATTRS, PRIORITIES, ConvAttrs
from engine.cache.disk_store import DiskStore
from engine.cache.disk_tier import DiskTier
from engine.cache.errors import ParkRefused
from engine.cache.explain import LookupReport, lookup_report
from engine.cache.identity import CacheIdentity, block_keys, token_array, tokens_key
from engine.cache.index import Conv, TierIndex
from engine.cache.journal import Journal
from engine.cache.parts import (
    Checkpoints,
    Parts,
    ReadParts,
    WriteParts,
    check_state,
)
from engine.cache.policy import common_prefix, decline_reason
from engine.cache.ram_tier import RamTier
from engine.cache.remote.backends import open_remote
from engine.cache.remote.tier import RemoteFigures, RemoteTier
from engine.cache.restores import resume_point
from engine.cache.settings import CacheSettings
from engine.cache.stats import CacheHit, CacheStats, ConversationInfo, ParkResult, PurgeResult, RestoreResult

log = logging.getLogger("strata.cache")
MIB = 1 << 20
TIERS = ("ram", "disk", "all")


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
        self.lock = threading.RLock()
        self.journal = Journal()
        self._spill_all = False  # enforce_budgets(spill_all=True) is running
        self.ram = RamTier(settings, identity, self.lock, self.journal, self._spill)
        self.disk: DiskStore | None = None
        if settings.uses_disk:
            self.disk = self.open_disk(settings)
            self.disk.start_writer()
            with self.lock:  # the folder as found, against the budgets it starts with
                self.disk.fit_found_folder()
                self.ram.enforce_budget()
        self.remote: RemoteTier | None = None
        if settings.remote_url:
            self.remote = open_remote(settings.remote_url, identity, self.lock, self.journal, days=settings.days,
                                      queue_bytes=settings.spill_queue_bytes, engine_version=engine_version)
        log.info(
            "conversation cache: storage %s, RAM %d MiB, disk %d MiB, %d slots, blocks of %d tokens (%.2f MiB)",
            settings.storage,
            settings.ram_bytes // MIB,
            settings.disk_bytes // MIB,
            settings.slots,
            identity.block_tokens,
            identity.block_bytes / MIB,
        )

    def open_disk(self, settings: CacheSettings) -> DiskStore:
        files = DiskTier(settings.dir, self.identity, engine_version=self.engine_version)
        files.open(days=settings.days)
        return DiskStore(settings, self.identity, self.lock, self.journal, files)

    def tiers(self) -> list[tuple[str, TierIndex]]:
        tiers = [("ram", self.ram.index)]
        if self.disk is not None:
            tiers.append(("disk", self.disk.index))
        return tiers

    def sources(self) -> list[tuple[str, TierIndex]]:
        """The tiers, and the remote tier's offers (what a restore may read from)."""
        return self.tiers() + ([("remote", self.remote.index)] if self.remote is not None else [])

    def reap(self) -> None:
        if self.disk is not None:
            self.disk.reap()

    # ------------------------------------------------------------------ lookup

    def lookup(self, tokens: Sequence[int], *, live_prefix: int = 0) -> CacheHit | None:
        """The longest parked prefix of `tokens` worth restoring (beyond `live_prefix`), or None. Read-only."""
        return self.explain_lookup(tokens, live_prefix=live_prefix)[0]

    def explain_lookup(self, tokens: Sequence[int], *, live_prefix: int = 0) -> tuple[CacheHit | None, LookupReport]:
        """`lookup`, and what it saw: the best candidate, the policy's verdict, a loss that would have offered more."""
        toks = token_array(tokens)
        if len(toks) < 2 or not self.settings.enabled:
            return None, LookupReport()
        keys = block_keys(self.identity.key, toks, self.identity.block_tokens)
        with self.lock:
            self.reap()  # a failed write gives its conversation's written version back before matching
            best, shared = self._local_best(toks, keys)
        if self.remote is not None:  # the network, without the lock: only for whole blocks beyond the local hit
            offer = self.remote.offer(toks, keys, have=best[0] if best else 0)
            best = (offer[0], "remote", offer[1]) if offer is not None else best
        with self.lock:
            report = lookup_report(self.journal.losses, toks, best, live_prefix)
            if self.identity.local_layers and best is not None and shared > best[0]:
                report = dataclasses.replace(report, window_shared=shared)
            if best is None or best[0] <= max(live_prefix, 0):
                return None, report
            n, tier, conv = best
            verdict = decline_reason(self.settings, self.identity, n=n, n_request=len(toks), live_prefix=live_prefix,
                                     bandwidth=self.journal.bandwidth[tier],
                                     prefill_tokens_per_s=self.prefill_tokens_per_s)
            detail = {**verdict.detail(), "offered": n, "n_min": self.settings.n_min,
                      "similarity": self.settings.similarity, "tier": tier}
            report = dataclasses.replace(report, verdict=verdict.reason, verdict_detail=detail)
            if verdict.reason:
                self.journal.declined_hit(verdict.reason)
                return None, report
            nbytes = n * self.identity.bytes_per_token + self.identity.state_bytes
            hit = CacheHit(conv.id, n, tier, nbytes, self.identity.key, conv.priority,
                           conv.pinned, tokens_key(self.identity.key, toks[:n]))
            return hit, report

    def _local_best(self, toks, keys: list[str]) -> tuple[tuple[int, str, Conv] | None, int]:
        """(the RAM or disk candidate offering most, the most any shares): caller holds the lock."""
        best: tuple[int, str, Conv] | None = None
        shared = 0  # a sliding-window model: the most a candidate shares, resumable or not
        for tier, index in self.tiers():
            for conv in index.candidates(keys):
                if conv.failed:
                    continue
                n = min(common_prefix(toks, conv.tokens), len(toks) - 1)
                shared = max(shared, n)
                if self.identity.state_parts:  # a recurrent state (or a window) resumes only where one was kept
                    n = resume_point(self.identity, index, conv, n)
                if best is None or n > best[0]:
                    best = (n, tier, conv)
        return best, shared

    def record_miss(self) -> None:
        with self.lock:
            self.journal.count("misses")

    # ------------------------------------------------------------------ park

    def park(
        self,
        tokens: Sequence[int],
        read_parts: ReadParts,
        *,
        keep: str | None = None,
        attrs: ConvAttrs = NO_ATTRS,
        checkpoints: Mapping[int, Parts] | None = None,
    ) -> ParkResult:
        """Park a slot's conversation: `tokens` are exactly the tokens whose state `read_parts(start, end)` returns.

        Captures only blocks this tier does not hold yet. `keep` names a conversation that must not be evicted
        (the hit about to be restored into this slot). `attrs`: what the request said about the conversation
        (unset values keep the parked line's, in any tier). A hybrid model's `checkpoints` are its recurrent state
        (state parts) by token position (<= len(tokens)); each is stored in the block it ends, else with the
        conversation. Never raises for a refusal: see `ParkResult.reason`.
        """
        t0 = time.perf_counter()
        try:
            toks = token_array(tokens)
        except ValueError as exc:
            return self._refuse("bad_tokens", str(exc), 0)
        with self.lock:
            self.reap()
            if self.disk is not None:
                self.disk.expire_if_due()
        if not self.settings.enabled:
            return self._refuse("off", "the conversation cache is off", len(toks))
        if len(toks) == 0:
            return self._refuse("empty", "nothing to park", 0)
        keys = block_keys(self.identity.key, toks, self.identity.block_tokens)
        try:
            states = Checkpoints.place(
                {int(p): check_state(self.identity.state_parts, parts) for p, parts in (checkpoints or {}).items()},
                len(toks), len(keys), self.identity.block_tokens, in_blocks=not self.identity.local_layers,
            )
        except ValueError as exc:
            return self._refuse("read_error", f"the slot's recurrent state: {exc}", len(toks))
        if checkpoints and not self.identity.state_parts:
            return self._refuse("read_error", "checkpoints given for a model without recurrent state", len(toks))
        with self.lock:  # the line may live in another tier than the one this park lands in (tiered)
            line = [c for _, index in self.tiers() for c in index.prefixes_of(toks) if not c.failed]
            attrs = ConvAttrs(*attrs.resolve(line))
            cause = self.journal.losses.begin("park", tokens=len(toks))
        try:
            conv, new_bytes, evicted, tier = self._park(toks, keys, read_parts, keep, attrs, states)
        except ParkRefused as exc:
            with self.lock:
                self.journal.losses.refused(toks, exc.reason)
            return self._refuse(exc.reason, str(exc), len(toks))
        finally:
            with self.lock:
                self.journal.losses.begin("budget")
        cause["conversation_id"] = conv.id  # the evictions it caused name the conversation that took the room
        ms = (time.perf_counter() - t0) * 1000
        with self.lock:
            self.journal.count("parks")
            self.journal.count("bytes_parked", new_bytes)
            self.journal.park_ms.add(ms)
            self.journal.event("park", conv.id, len(toks), new_bytes, ms, tier)
        log.info(
            "conversation cache: parked %s in %s: %d tokens, %.1f MiB new, %.1f ms",
            conv.id,
            tier,
            len(toks),
            new_bytes / MIB,
            ms,
        )
        if self.remote is not None:
            self._write_through(conv, toks, keys, read_parts)
        return ParkResult(True, conv.id, "", tier, len(toks), new_bytes, ms, evicted)

    def _write_through(self, conv: Conv, toks, keys: list[str], read_parts: ReadParts) -> None:
        """Queue a park for the remote store: a block a tier holds in RAM by reference, a written one as its file."""
        assert self.remote is not None
        disk = self.disk
        with self.lock:
            held = {k: blk.data for _, index in self.tiers() for k in keys
                    if (blk := index.blocks.get(k)) is not None and blk.data is not None}
            filed = {k for k in keys if disk is not None and (blk := disk.index.blocks.get(k)) is not None
                     and blk.on_disk}
            stated = {k for _, index in self.tiers() for k in keys if (blk := index.blocks.get(k)) is not None
                      and blk.state}
            own = {p: parts for p, parts in conv.checkpoints.items() if parts is not None}  # not only on disk
        load = disk.files.block_file_bytes if disk is not None else None
        self.remote.publish(conv.id, toks, keys, held, read_parts, conv.tail, filed=filed, load=load,
                            checkpoints=own, stated=stated)

    def _park(self, toks, keys, read_parts: ReadParts, keep: str | None, attrs: ConvAttrs,
              states: Checkpoints) -> tuple[Conv, int, int, str]:
        if not self.settings.uses_ram:
            if self.disk is None:
                raise ParkRefused("disk_unavailable", "no disk tier")
            return (*self.disk.park(toks, keys, read_parts, keep, attrs, states=states), "disk")
        try:
            return (*self.ram.park(toks, keys, read_parts, keep, attrs, states), "ram")
        except ParkRefused as exc:
            fallback = self.settings.storage == "tiered" and exc.reason in (
                "larger_than_budget", "floor", "priority", "no_room")
            if not (fallback and self.disk is not None):
                raise
            log.info("conversation cache: %s; parking on disk instead", exc)
            # RAM is full of conversations that outrank this one, or that are in use (the hit about to be
            # restored into this slot: with one slot and room for one conversation, every switch back would
            # otherwise drop the one switched out): the disk may still take it, through the writer; refused for
            # its size or the floor, it is written before returning (staging it in RAM would defeat the reason
            # RAM refused it)
            background = exc.reason in ("priority", "no_room")
            return (*self.disk.park(toks, keys, read_parts, keep, attrs, background=background,
                                    states=states), "disk")

    def _refuse(self, reason: str, message: str, n_tokens: int) -> ParkResult:
        with self.lock:
            self.journal.refused(reason)
            self.journal.event("refuse", None, n_tokens, 0, 0.0, "", reason=reason)
        level = logging.DEBUG if reason in ("off", "empty") else logging.WARNING
        log.log(level, "conversation cache: park of %d tokens refused: %s", n_tokens, message)
        return ParkResult(False, None, reason, n_tokens=n_tokens)

    def _spill(self, conv: Conv, tensors: dict[str, Parts | None]) -> None:
        """What RAM evicts: tiered mode queues it for the disk writer; otherwise it is gone. The write buffer's
        bound holds, except while `enforce_budgets(spill_all=True)` runs (a settings change)."""
        disk = self.disk
        if self.settings.storage == "tiered" and disk is not None and disk.usable:
            disk.queue_spill(conv, tensors, bounded=not self._spill_all)

    # ------------------------------------------------------------------ restore

    def restore(self, hit: CacheHit, write_parts: WriteParts) -> RestoreResult:
        """Validate and gather the hit's state in host memory, then `write_parts(start, parts)` for [0, hit.n_tokens).

        Raises CacheRestoreError before the first `write_parts` when anything is wrong; exceptions of `write_parts`
        itself propagate (the engine then clears the slot). See restores.py.
        """
        return restores.restore(self, hit, write_parts)

    def begin_restore(self, hit: CacheHit) -> restores.RestoreRead:
        """`restore` in steps: checks and pins now (CacheRestoreError), `read()` on any thread, `deliver` on this
        one. See restores.py."""
        return restores.RestoreRead(self, hit)

    def _find(self, hit: CacheHit) -> tuple[str, Conv] | None:
        return restores.find_entry(self, hit)

    # ------------------------------------------------------------------ purge, listing, stats, events

    def purge(self, tier: str) -> PurgeResult:
        """Drop every parked conversation of `tier` ("ram", "disk" or "all"); in-flight entries are skipped."""
        if tier not in TIERS:
            raise ValueError(f"tier: expected ram, disk or all, got {tier!r}")
        dropped, freed = 0, 0
        skipped: list[tuple[str, str]] = []
        with self.lock:
            self.journal.losses.begin("purge")
            self.reap()
            if tier in ("ram", "all"):
                dropped, freed = self.ram.purge()
            if tier in ("disk", "all") and self.disk is not None:
                n, nbytes, skipped = self.disk.purge()
                dropped, freed = dropped + n, freed + nbytes
        log.info(
            "conversation cache: purged %s: %d conversations, %.1f MiB; %d skipped",
            tier,
            dropped,
            freed / MIB,
            len(skipped),
        )
        return PurgeResult(dropped, freed, skipped, tier)

    def drop(self, conv_id: str) -> PurgeResult:
        """Drop one parked conversation from every tier that holds it (a person's choice, like a purge of one: it
        is recorded as purged, never spilled). Raises KeyError for an id not parked. On disk, an entry being
        written or read, or whose manifest cannot be removed, stays and is reported as skipped."""
        with self.lock:
            self.reap()
            in_ram = conv_id in self.ram.index.convs
            on_disk = self.disk is not None and conv_id in self.disk.index.convs
            if not (in_ram or on_disk):
                raise KeyError(conv_id)
            self.journal.losses.begin("purge")
            try:
                dropped = freed = 0
                skipped: list[tuple[str, str]] = []
                if in_ram:
                    freed, dropped = self.ram.evict(conv_id, spill=False, reason="purge"), 1
                if on_disk:
                    assert self.disk is not None
                    why = self.disk.removable(conv_id)
                    if why:
                        skipped.append((conv_id, why))
                    else:
                        freed, dropped = freed + self.disk.remove(conv_id, reason="purge"), 1
            finally:
                self.journal.losses.begin("budget")
        log.info("conversation cache: dropped %s (%.1f MiB)%s", conv_id, freed / MIB,
                 f"; skipped on disk: {skipped[0][1]}" if skipped else "")
        return PurgeResult(dropped, freed, skipped, "all")

    def conversations(self) -> list[ConversationInfo]:
        """Every parked conversation, most recently used first."""
        with self.lock:
            return views.conversation_rows(self.tiers(), self.identity.state_bytes)

    def set_attrs(self, conv_id: str, *, priority: str | None = None, pinned: bool | None = None) -> str:
        """Change a parked conversation's priority and/or pin in every tier that holds it (a written manifest is
        rewritten, so the change survives a restart); returns the id it is parked under now (a superseded id
        leads to the conversation that continued it). Raises KeyError for an id not parked, ValueError for
        a priority that is not one of PRIORITIES. Eviction follows the new values from the next park on."""
        if priority is not None and priority not in PRIORITIES:
            raise ValueError(f"priority: expected one of {', '.join(PRIORITIES)}, got {priority!r}")
        with self.lock:
            self.reap()
            found = self._find(CacheHit(conv_id, 0, "ram", 0))
            if found is None:
                raise KeyError(conv_id)
            target = found[1].id
            for tier, index in self.tiers():
                conv = index.convs.get(target)
                if conv is None:
                    continue
                old = conv.priority, conv.pinned
                conv.priority = priority or conv.priority
                conv.pinned = conv.pinned if pinned is None else pinned
                if tier == "disk" and self.disk is not None and (conv.priority, conv.pinned) != old:
                    self.disk.record_use(conv)  # a pending entry records it when written (its history changed)
            return target

    def stats(self) -> CacheStats:
        with self.lock:
            remote = self.remote.figures() if self.remote is not None else RemoteFigures()
            return views.cache_stats(self.settings, self.ram, self.disk, self.journal, remote,
                                     block_tokens=self.identity.block_tokens,
                                     prefill_tokens_per_s=self.prefill_tokens_per_s)

    def events(self, limit: int = 200) -> list[dict]:
        """The most recent park/restore/evict/spill/refuse events, oldest first."""
        with self.lock:
            return list(self.journal.events)[-limit:] if limit > 0 else []

    # ------------------------------------------------------------------ budgets, reconfigure, flush, close

    def enforce_budgets(self, *, spill_all: bool = False) -> int:
        """Evict LRU conversations until every tier is within its budget and slot count. `spill_all`: tiered RAM
        evictions are all queued for the disk, past the write buffer's bound (the caller then drains the writer):
        a smaller RAM budget moves conversations to disk rather than dropping what the buffer cannot hold at
        once. Their RAM is the RAM tier's until written, so nothing more is held than before the change. Returns
        how many conversations RAM gave up."""
        with self.lock:
            before = len(self.ram.index.convs)
            self._spill_all = spill_all
            try:
                self.ram.enforce_budget()
            finally:
                self._spill_all = False
            if self.disk is not None:
                self.disk.enforce_budget()
            return before - len(self.ram.index.convs)

    def set_settings(self, settings: CacheSettings) -> None:
        self.settings = self.ram.settings = settings
        if self.disk is not None:
            self.disk.settings = settings
        if self.remote is not None:  # --conversation-cache-days is live: the next writes take the new time to live
            self.remote.set_days(settings.days)

    def reconfigure(self, settings: CacheSettings) -> list[str]:
        """Apply new settings live; returns the names that changed (engine/cache/reconfigure.py)."""
        return reconfigure.apply(self, settings)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait up to `timeout` seconds for every pending disk write (disk-mode parks, tiered spills) to land.

        True when nothing is left pending and no write failed meanwhile (failures are counted in
        `spill_failed` and logged; the entry is dropped and any version of it already on disk is kept).
        """
        disk, deadline = self.disk, time.monotonic() + max(timeout, 0.0)
        with self.lock:
            failed = self.journal.counts["spill_failed"]
        done = disk.drain(deadline) if disk is not None else True
        if self.remote is not None:
            done = self.remote.drain(deadline) and done
        with self.lock:
            self.reap()
            left = self.disk is not None and self.disk.staging.any_pending()
            return done and not left and self.journal.counts["spill_failed"] == failed

    def close(self, *, spill: bool, deadline_s: float = 30.0) -> None:
        """Stop the cache. Tiered with `spill`: write everything parked to disk within the deadline (logged if hit)."""
        deadline = time.monotonic() + deadline_s
        disk = self.disk
        with self.lock:
            self.reap()
            if spill and self.settings.storage == "tiered" and disk is not None and disk.writing:
                for cid in reversed(list(self.ram.index.convs)):  # most recently used first
                    conv = self.ram.index.convs[cid]
                    disk.queue_spill(conv, self.ram.data_of(conv), bounded=False)
        if self.remote is not None:
            self.remote.close(deadline)
        if disk is None:
            return
        if not disk.stop_writer(deadline):
            with self.lock:
                left = sum(1 for c in disk.index.convs.values() if not c.on_disk)
            log.warning(
                "conversation cache: shutdown deadline of %.0f s hit; %d conversations not written",
                deadline_s,
                left,
            )
        with self.lock:
            disk.files.close()
