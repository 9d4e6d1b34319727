"""The disk tier's state: its index, its budget, the entries in flight, and what the writer reports.

Owns (besides the files, through `DiskTier`) the disk index, the orphans (entries evicted while the writer held
them), the results the writer has reported but the engine thread has not applied yet, and the writer itself.
The park path (staged for the writer or written now) is `disk_parks`.

The budget is planned in one place, `_room`: a park (staged or written now), a tiered spill and a budget
change all ask it which LRU entries must go. Every move of an entry into the index has two phases: `_reserve`
holds the blocks it reuses (and pins the pending ones it writes itself) so nothing evicted meanwhile frees
them; then `_publish` indexes the entry and releases them, or `_rollback` releases them and removes any file
written for it. An entry or block in flight (pinned, or WRITING) is never freed: evicted while being written,
it leaves the index at once and its files go when the writer reports (`_reap`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from engine.cache import disk_parks
from engine.cache.attrs import ConvAttrs
from engine.cache.disk_scan import DAY
from engine.cache.disk_tier import DiskTier
from engine.cache.errors import ParkRefused
from engine.cache.identity import CacheIdentity
from engine.cache.index import Block, Conv
from engine.cache.journal import Journal
from engine.cache.lifecycle import EntryState
from engine.cache.parts import NO_CHECKPOINTS, Checkpoints, Parts, ReadParts, parts_nbytes
from engine.cache.policy import plan_room, rank_of
from engine.cache.ram_tier import RESERVED, inherit, refuse_room
from engine.cache.settings import CacheSettings
from engine.cache.staging import StagingBound
from engine.cache.writer import DiskWriter, WriteJob, WriteResult

log = logging.getLogger("strata.cache")
MIB = 1 << 20


@dataclass(slots=True)
class Reservation:
    """Phase one of a move into the index: what is held until `_publish` or `_rollback`."""

    reused: list[str]  # keys of blocks the entry reuses, held under RESERVED
    victims: list[str]  # entries to evict (planned by `_room`)
    pinned: list[tuple[str, Parts | None]] = field(default_factory=list)  # pending blocks written now


class DiskStore:
    def __init__(
        self,
        settings: CacheSettings,
        identity: CacheIdentity,
        lock: threading.RLock,
        journal: Journal,
        files: DiskTier,
    ) -> None:
        self.settings = settings
        self.identity = identity
        self.files = files
        self.index = files.index
        self.lock = lock
        self.journal = journal
        self._orphans: set[Conv] = set()
        self._results: list[WriteResult] = []
        self.writer: DiskWriter | None = None
        self._next_expiry = 0.0
        self.staging = StagingBound(self)

    @property
    def usable(self) -> bool:
        return not self.files.error

    # ------------------------------------------------------------------ budget: one planner, two phases

    def room(
        self,
        keys: list[str],
        n_tokens: int,
        *,
        leaving: set[str],
        exclude: set[str],
        rank: int,
        in_flight_ok: bool = False,
        states: Checkpoints = NO_CHECKPOINTS,
    ) -> tuple[int, list[str]]:
        """(blocks already held, victims) for an entry of `keys`/`n_tokens` and priority `rank` under the disk
        budget and slots.

        Raises ParkRefused("larger_than_budget", "priority" or "no_room"); nothing is changed here."""
        s, idx, files = self.settings, self.index, self.files
        have = idx.matched_blocks(keys)
        manifest = files.manifest_size(n_tokens, len(states.own), states.own_bytes)
        checkpoints = len(states.blocks) * files.identity.state_bytes  # (a header allowance is in block_size)
        total = len(keys) * files.block_size() + checkpoints + manifest
        if total > s.disk_bytes:
            raise ParkRefused(
                "larger_than_budget",
                f"{total / MIB:.1f} MiB conversation is larger than the whole disk budget ({s.disk_bytes / MIB:.0f} MiB)",
            )
        plan = plan_room(
            idx,
            need_bytes=(len(keys) - have) * files.block_size() + states.new_blocks(have) * files.identity.state_bytes
            + manifest,
            budget=s.disk_bytes,
            slots=s.slots,
            keep_keys=set(keys),
            leaving=leaving | self.superseded_pending(),
            exclude=exclude,
            in_flight_ok=in_flight_ok,
            rank=rank,
        )
        if not plan.ok:
            raise refuse_room(plan, "on disk")
        return have, plan.victims

    def reserve(self, keys: list[str], have: int, victims: list[str], *, pin_pending: bool) -> Reservation:
        res = Reservation(keys[:have], victims)
        self.index.reserve(res.reused, RESERVED)
        if pin_pending:
            # blocks indexed but still waiting for the writer are written by this park too: a published
            # manifest only ever names published block files
            res.pinned = [(k, self.index.blocks[k].data) for k in res.reused if not self.index.blocks[k].on_disk]
            for k, _ in res.pinned:
                self.index.blocks[k].pins += 1
        return res

    def publish(self, res: Reservation, conv: Conv, new_blocks: list[Block], written: dict[str, int]) -> None:
        idx = self.index
        for k, _ in res.pinned:
            blk = idx.blocks[k]
            blk.pins -= 1
            if k in written:
                self._mark_block_written(blk, written[k])
        idx.add(conv, new_blocks)
        idx.release(res.reused, RESERVED)

    def rollback(self, res: Reservation, written: dict[str, int]) -> None:
        for k, _ in res.pinned:
            self.index.blocks[k].pins -= 1
        self.index.release(res.reused, RESERVED)
        self.files.delete_blocks([k for k in written if k not in self.index.blocks])

    def fit_found_folder(self) -> None:
        """The folder as found at start against the budgets it starts with (which may have shrunk while the engine
        was stopped): what does not fit goes in eviction order, pinned conversations never (they stay, over
        budget, until unpinned, deleted or purged), and the log says what went, what stayed and why. Caller holds
        the lock."""
        found, found_bytes = len(self.index.convs), self.index.bytes
        dropped = self.enforce_budget(keep_pinned=True)
        budget_mib = self.settings.disk_bytes // MIB
        if dropped:
            log.warning(
                "conversation cache: the folder held %d conversations (%.1f MiB), over the disk budget of %d MiB "
                "or %d conversations: dropped %d in eviction order (%.1f MiB: %s), kept %d",
                found, found_bytes / MIB, budget_mib, self.settings.slots, len(dropped),
                sum(b for _, _, b in dropped) / MIB,
                ", ".join(f"{cid} ({n} tokens)" for cid, n, _ in dropped[:8])
                + (f" and {len(dropped) - 8} more" if len(dropped) > 8 else ""), len(self.index.convs))
        if self.index.bytes > self.settings.disk_bytes:
            pinned = [c for c in self.index.convs.values() if c.pinned]
            log.warning(
                "conversation cache: %d pinned conversations (%.1f MiB) are kept over the disk budget of %d MiB: "
                "a budget never drops a pinned conversation at start-up; unpin, delete or purge them, or raise "
                "the budget", len(pinned), sum(c.nbytes for c in pinned) / MIB, budget_mib)

    def superseded_pending(self) -> set[str]:
        """Entries a queued write supersedes: removed once it is written (reap), so a budget does not count them
        beside their successor (several spills queued at once would otherwise push out conversations that fit)."""
        return {old for conv in self.index.convs.values() if not conv.on_disk and not conv.failed
                for old in conv.supersedes}

    def enforce_budget(self, *, keep_pinned: bool = False) -> list[tuple[str, int, int]]:
        """Evict entries in eviction order (never one in flight) until the tier is within its budget and slots;
        `keep_pinned` passes over pinned ones (the folder found at start-up). Returns (id, tokens, bytes) of each
        entry evicted."""
        plan = plan_room(
            self.index,
            need_bytes=0,
            budget=self.settings.disk_bytes,
            slots=self.settings.slots,
            keep_keys=set(),
            leaving=self.superseded_pending(),
            exclude={cid for cid, c in self.index.convs.items() if c.pinned} if keep_pinned else set(),
            adding=0,
            best_effort=True,
        )
        dropped = []
        for cid in plan.victims:
            if cid in self.index.convs:
                conv = self.index.convs[cid]
                dropped.append((cid, conv.n_tokens, self.remove(cid, reason="evict")))
        return dropped

    def expire_if_due(self) -> None:
        now = time.time()
        if now < self._next_expiry or self.settings.days <= 0:
            return
        self._next_expiry = now + 60
        idx = self.index
        for cid, conv in list(idx.convs.items()):
            if conv.on_disk and now - conv.last_used > self.settings.days * DAY and not idx.is_pinned(conv):
                self.remove(cid, reason="expire")

    # ------------------------------------------------------------------ parks (disk mode, tiered fallback)

    def park(
        self,
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
        See `disk_parks.park` for `background`."""
        return disk_parks.park(self, toks, keys, read_parts, keep, attrs, background=background, states=states)

    # ------------------------------------------------------------------ tiered spills

    def queue_spill(self, conv: Conv, tensors: dict[str, Parts | None], *, bounded: bool = True) -> bool:
        """Index a RAM-evicted conversation as PENDING and queue its write; False (counted) when it cannot fit.

        Caller holds the lock."""
        idx = self.index
        superseded = [c for c in idx.prefixes_of(conv.tokens) if not c.failed]
        for same in (c for c in superseded if c.n_tokens == conv.n_tokens):
            if same.attrs != conv.attrs:  # changed in RAM (a PATCH) since it was written
                same.set_attrs(conv.attrs)
                self.record_use(same)
            return True  # already on disk (or on its way)
        try:
            have, victims = self.room(
                conv.keys, conv.n_tokens, leaving={c.id for c in superseded}, exclude=set(), rank=rank_of(conv.priority),
                states=Checkpoints({}, dict(conv.checkpoints)),  # type: ignore[arg-type]
            )
        except ParkRefused as exc:
            self.journal.count("spill_dropped")
            if exc.reason == "priority":
                self.journal.refused("priority")
            self.journal.event("spill_drop", conv.id, conv.n_tokens, 0, 0.0, "disk", reason=str(exc))
            log.warning("conversation cache: %s for %s (%d tokens); dropped", exc, conv.id, conv.n_tokens)
            return False
        # Hold the blocks this spill reuses: evicting a victim that shares them must not free them.
        res = self.reserve(conv.keys, have, victims, pin_pending=False)
        for cid in victims:
            self.remove(cid, reason="evict")
        conv_id = conv.id if conv.id not in idx.convs else inherit([])[0]
        new_blocks = [Block(k, self.files.block_size(self._has_state(tensors[k])), data=tensors[k],
                            state=self._has_state(tensors[k])) for k in conv.keys[have:]]
        pending = Conv(
            conv_id,
            conv.tokens,
            list(conv.keys),
            self.files.manifest_size(conv.n_tokens, len(conv.checkpoints),
                                     sum(parts_nbytes(p) for p in conv.checkpoints.values())),
            tail=conv.tail,
            created=conv.created,
            last_used=conv.last_used,
            hits=conv.hits,
            state=EntryState.PENDING,
            supersedes=[c.id for c in superseded],
            checkpoints=dict(conv.checkpoints),
        )
        pending.set_attrs(conv.attrs)
        self.publish(res, pending, new_blocks, {})
        assert self.writer is not None
        self.writer.submit(conv_id)
        if bounded:
            self.staging.bound(keep=conv_id)
        return True

    def _has_state(self, parts: Parts | None) -> bool:
        """A block's parts carry the checkpoint at its end."""
        specs = self.identity.state_parts
        return bool(specs) and parts is not None and specs[0].name in parts

    # ------------------------------------------------------------------ removal

    def record_use(self, conv: Conv) -> None:
        """A written conversation was used (restored, or parked again unchanged): its manifest keeps the new
        last use and hit count, so a restart or a crash does not lose them. Called under the lock, which keeps
        an eviction from removing the manifest while it is rewritten."""
        if conv.on_disk and self.index.convs.get(conv.id) is conv:
            self.index.bytes += self.files.touch(conv)

    def evict(self, conv_id: str) -> None:
        """Evict an entry; one being written leaves the index now and its files once the writer is done."""
        conv = self.index.convs[conv_id]
        for c in (conv, conv.previous):
            if c is not None and c.busy:
                self._orphans.add(c)
        if conv.previous is not None and conv.previous.busy:
            conv.previous = None  # its manifest is being published: removed by _reap, not now
        self.remove(conv_id, reason="evict")

    def _mark_block_written(self, blk: Block, size: int) -> None:
        blk.on_disk = True
        blk.data = None
        self.index.bytes += size - blk.nbytes
        blk.nbytes = size

    def remove(self, conv_id: str, *, reason: str = "") -> int:
        """Drop an entry (written or pending, never one in flight) and the files no one else needs; returns
        the bytes freed (files that could not be removed are not counted). Caller holds the lock."""
        idx = self.index
        before = idx.bytes
        conv, freed = idx.remove(conv_id)
        stuck = self.files.delete_conv(conv, freed)
        if conv.previous is not None and not conv.on_disk:
            self.files.delete_conv(conv.previous, [])  # the written version it was to replace goes too
            conv.previous = None
        if self.writer is not None:
            self.writer.forget(conv_id)
        if reason:
            full = len(idx.convs) + 1 >= self.settings.slots
            self.journal.losses.dropped(conv.tokens, conv_id, reason, "disk", slots_full=full)
            if reason == "evict":
                self.journal.count("evictions")
            self.journal.event(reason, conv_id, conv.n_tokens, before - idx.bytes - stuck, 0.0, "disk")
        return before - idx.bytes - stuck

    def purge(self) -> tuple[int, int, list[tuple[str, str]]]:
        """Drop every entry not in flight; returns (conversations, bytes really removed, skipped with why).

        A conversation whose manifest cannot be removed (a read-only folder) stays parked and is skipped: it
        would come back at the next start. Caller holds the lock."""
        dropped, freed, skipped = 0, 0, []
        for cid in list(self.index.convs):
            why = self.removable(cid)
            if why:
                skipped.append((cid, why))
                continue
            freed += self.remove(cid, reason="purge")
            dropped += 1
        return dropped, freed, skipped

    def removable(self, conv_id: str) -> str:
        """Remove an entry's manifest so it is gone for good; "" when done, else why it stays (in flight, or a
        manifest that cannot be removed: it would come back at the next start). Caller holds the lock."""
        conv = self.index.convs[conv_id]
        if self.index.is_pinned(conv):
            return "being written to or read from disk"
        error = self.files.remove_manifest(conv)
        # The file by its name in the cache folder: the reason goes to HTTP clients, the folder's path is the
        # operator's (GET /cache/config shows it to those who may see it).
        name = os.path.basename(self.files.conv_path(conv.id))
        return f"its manifest {name} in the cache folder cannot be removed: {error}" if error else ""

    # ------------------------------------------------------------------ the writer and what it reports

    def start_writer(self) -> None:
        if self.writer is None:
            self.writer = DiskWriter(self.lock, self.files, self._claim, self._report)
            self.writer.start()

    @property
    def writing(self) -> bool:
        return self.writer is not None

    def drain(self, deadline: float) -> bool:
        return self.writer.drain(deadline) if self.writer is not None else True

    def stop_writer(self, deadline: float) -> bool:
        """Let the writer finish what is queued until `deadline` (monotonic); True when everything was written."""
        if self.writer is None:
            return True
        done = self.writer.drain(deadline)
        self.writer.stop(deadline)
        with self.lock:
            self.reap()
            self.writer = None
        return done

    def _claim(self, conv_id: str) -> WriteJob | None:
        """Phase one of a write (writer thread, lock held): PENDING -> WRITING, its unwritten blocks pinned."""
        conv = self.index.convs.get(conv_id)
        if conv is None or conv.state is not EntryState.PENDING:
            return None
        conv.move(EntryState.WRITING)
        blocks = [self.index.blocks[k] for k in conv.keys if not self.index.blocks[k].on_disk]
        for blk in blocks:
            blk.pins += 1
        return WriteJob(
            conv, [(blk.key, blk.data) for blk in blocks], conv.tail, extra=blocks, history=conv.history
        )

    def _report(self, result: WriteResult) -> None:
        """Phase two (writer thread, lock held): publish the written blocks and the entry, or mark it FAILED."""
        conv = result.job.conv
        blocks = result.job.extra
        assert isinstance(blocks, list), "the job carries the blocks phase one pinned"
        idx = self.index
        for blk in blocks:
            blk.pins -= 1
            if blk.key in result.sizes and blk.key in idx.blocks:
                self._mark_block_written(blk, result.sizes[blk.key])
        if result.error:
            conv.error = result.error
            conv.move(EntryState.FAILED)
            self.files.write_failed(f"conversation {conv.id}", result.error)
        else:
            self.files.write_succeeded()
            conv.move(EntryState.WRITTEN)
            conv.tail = None
            conv.checkpoints = dict.fromkeys(conv.checkpoints)  # on disk now: RAM keeps only the positions
            conv.previous = None  # its manifest replaced the previous version's
            if idx.convs.get(conv.id) is conv:
                idx.bytes += result.manifest_bytes - conv.nbytes
            conv.nbytes = result.manifest_bytes
            if conv.history != result.job.history:
                self.record_use(conv)  # used or changed while it was written: the manifest records the claim's
            written = sum(result.sizes.values()) + result.manifest_bytes
            self.journal.count("spills")
            self.journal.count("bytes_spilled", written)
            self.journal.event("spill", conv.id, conv.n_tokens, written, result.ms, "disk")
        self._results.append(result)

    def reap(self) -> None:
        """Apply what the writer reported (engine thread, lock held): drop the entries a finished write
        supersedes, drop failed writes (their previous version comes back), remove orphans' files."""
        results, self._results = self._results, []
        idx = self.index
        for result in results:
            written = result.job.conv
            if written in self._orphans:
                self._orphans.discard(written)
                self._remove_orphan(written)
                continue
            conv_id = written.id
            conv = idx.convs.get(conv_id)
            if conv is not written:
                # removed, or replaced by a newer version of its line that keeps it as the version on disk
                if written.failed and conv is not None and conv.previous is written:
                    conv.previous = written.previous  # the one before it is still the file on disk
                    written.previous = None
                    self.journal.count("spill_failed")
                    log.warning(
                        "conversation cache: writing %s to disk failed (%s); its newer version is pending",
                        conv_id,
                        written.error,
                    )
                continue
            if written.on_disk:
                for old in conv.supersedes:
                    if old in idx.convs and old != conv_id and not idx.is_pinned(idx.convs[old]):
                        self.remove(old)
                        self.journal.redirect(old, conv_id)
                conv.supersedes = []
            elif idx.is_pinned(conv):
                self._results.append(result)  # dropped once its reader is done
            else:
                self.journal.count("spill_failed")
                log.warning(
                    "conversation cache: writing %s to disk failed (%s); dropped%s; nothing already on disk was lost",
                    conv_id,
                    written.error,
                    ", its previously written version is kept" if conv.previous is not None else "",
                )
                self.staging.drop_pending(conv, "spill_failed")

    def _remove_orphan(self, written: Conv) -> None:
        """Remove the files a write published for an entry evicted meanwhile."""
        if written.on_disk and written.id not in self.index.convs:
            self.files.delete_conv(written, [])
        self.files.delete_blocks([k for k in written.keys if k not in self.index.blocks])

