"""The remote tier: write-through of parks to a shared store, lookups of a request's longest stored prefix,
and the store's health, so that a failing store never changes how the engine serves.

- Parks: the engine thread hands over the blocks the store may lack (references to what a local tier holds in
  RAM, written disk blocks by name, else a copy from the slot), the conversation's last partial block and a
  hybrid model's own checkpoints; the writer thread checks which blocks the store holds (refreshing their time
  to live), sends the others (a disk block as its file), then the manifest and the holder pointers. The RAM
  held by writes not sent yet is bounded (`queue_bytes`): when full, the oldest write is dropped and counted.
- Lookups (engine thread, outside the cache lock): one pipelined EXISTS over the request's block keys gives the
  longest stored prefix (keys chain, so presence is monotone), then a GET fetches the manifest stored under the
  last of them, or the one its holder pointer names. What is offered sits in a small index of offers, holding
  no K/V: restores read the blocks from the store (`pieces`, on the restore reader thread).
- Failures: a store that cannot be reached is marked down, skipped by lookups and writes, and probed again by
  the writer every PROBE_S seconds; full, read-only or denied stores keep serving reads. Each change of state
  is logged once and shown in /metrics (`remote_state`, `remote_error`), every failed call is counted.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from engine.cache.errors import CacheRestoreError, ParkRefused
from engine.cache.fileformat import FileFormatError
from engine.cache.identity import CacheIdentity, block_keys
from engine.cache.index import Block, Conv, TierIndex
from engine.cache.journal import Journal
from engine.cache.parts import Parts, ReadParts, parts_nbytes
from engine.cache.policy import common_prefix
from engine.cache.ram_tier import capture
from engine.cache.remote.store import Kind, RemoteStore, StoreError
from engine.cache.remote.values import Manifest, decode_block, decode_manifest, encode_block, encode_manifest
from engine.cache.restores import resume_point

log = logging.getLogger("strata.cache")
MIB = 1 << 20
PROBE_S = 10.0  # how often the writer asks the store how full it is, and retries a store that was down
MAX_OFFERS = 8  # lookups' offers kept for the restores that may follow them
MAX_KNOWN = 1 << 16  # block keys known to be in the store: a park captures no copy of those
FETCH_BLOCKS = 16  # blocks per MGET of a restore: tens of MiB, the next batch in flight while one is verified
MIN_TTL_S = 3600
CONV_ID = re.compile(r"[0-9a-f]{16}")
BLOCK_KEY = re.compile(r"[0-9a-f]{32}")  # the ids engines give conversations (secrets.token_hex(8))  # --conversation-cache-days 0 cannot empty a shared store: entries then live an hour


@dataclass(slots=True)
class Upload:
    """One park to send: the blocks the store may lack (by key), all its keys, its tokens and partial block."""

    conv_id: str
    tokens: np.ndarray
    keys: list[str]
    blocks: dict[str, Parts]
    tail: Parts | None
    load: Callable[[str], bytes] | None = None  # a written disk block's file, for a block not in `blocks`
    checkpoints: dict[int, Parts] = field(default_factory=dict)  # a hybrid model's own, by position
    block_states: list[int] = field(default_factory=list)  # blocks (by index) stored with their end's state

    @property
    def nbytes(self) -> int:
        return (sum(parts_nbytes(p) for p in self.blocks.values()) + parts_nbytes(self.tail)
                + sum(parts_nbytes(p) for p in self.checkpoints.values()))


@dataclass(frozen=True, slots=True)
class RemoteFigures:
    """What /metrics shows of the tier besides its counters (engine.figures.CacheFigures' remote_* gauges)."""

    remote: str = ""
    remote_state: str = ""
    remote_error: str = ""
    remote_bytes: int = 0
    remote_max_bytes: int = 0


class RemoteTier:
    """The store as one more tier of one model identity's cache; shares the cache's lock and journal."""

    def __init__(self, store: RemoteStore, shown: str, identity: CacheIdentity, lock: threading.RLock,
                 journal: Journal, *, days: float, queue_bytes: int, engine_version: str) -> None:
        self.store, self.shown, self.identity = store, shown, identity
        self.lock, self.journal = lock, journal
        self.ttl_s = MIN_TTL_S
        self.set_days(days)
        self.queue_bytes = queue_bytes
        self.engine_version = engine_version
        self.index = TierIndex("remote")  # the offers of recent lookups: keys and tokens, no K/V
        self.known: OrderedDict[str, None] = OrderedDict()
        self.state = "connecting"  # "up", or a StoreError state
        self.error = ""
        self.retry_at = 0.0
        self.used_bytes = self.max_bytes = 0
        self._queue: deque[Upload] = deque()
        self._queued_bytes = 0
        self._cond = threading.Condition(lock)
        self._stopping = False
        self._sending = False  # the writer holds a park it took off the queue
        self._thread: threading.Thread | None = None

    def set_days(self, days: float) -> None:
        """Entries written or refreshed from now on expire after `days` (at least MIN_TTL_S)."""
        self.ttl_s = max(int(days * 86400), MIN_TTL_S)

    # ------------------------------------------------------------------ health

    def start(self) -> None:
        """Probe the store once (a start-up that cannot reach it logs why and goes on), then start the writer."""
        self._probe()
        self._thread = threading.Thread(target=self._run, name="strata-remote-writer", daemon=True)
        self._thread.start()

    @property
    def reachable(self) -> bool:
        """Worth a network call now: not known to be down, or due for another try."""
        return self.state != "down" or time.monotonic() >= self.retry_at

    def _probe(self) -> None:
        try:
            usage = self.store.usage()
        except StoreError as exc:
            self._failed(exc, "probing")
            return
        with self.lock:
            self.used_bytes, self.max_bytes = usage.used_bytes, usage.max_bytes
        first = self.state == "connecting"
        self._succeeded()
        if first:
            log.info("conversation cache: remote store %s: %.0f MiB used of %s, eviction %s, entries expire "
                     "after %.1f h", self.shown, usage.used_bytes / MIB,
                     f"{usage.max_bytes // MIB} MiB" if usage.max_bytes else "no maxmemory", usage.policy,
                     self.ttl_s / 3600)
            if not usage.max_bytes or usage.policy == "noeviction":
                log.warning("conversation cache: remote store %s has %s: once full, its writes fail (counted, "
                            "serving goes on); set maxmemory and maxmemory-policy allkeys-lru (or volatile-lru) "
                            "there", self.shown, "no maxmemory" if not usage.max_bytes else "policy noeviction")

    def _failed(self, exc: StoreError, what: str) -> None:
        """Count a failed call; log once per change of state; a store that is down is left alone until a probe."""
        with self.lock:
            self.journal.count("remote_errors")
            changed = exc.state != self.state
            self.state, self.error = exc.state, f"{exc.state}: {exc}"
            if exc.state == "down":
                self.retry_at = time.monotonic() + PROBE_S
        if changed:
            log.warning("conversation cache: remote store %s failed while %s: %s; serving goes on from RAM and disk "
                        "(tried again every %.0f s)", self.shown, what, exc, PROBE_S)

    def _succeeded(self, *, wrote: bool = False) -> None:
        """A call went through; a full or read-only store stays so until a write goes through."""
        with self.lock:
            if not wrote and self.state in ("full", "read_only"):
                return
            was, self.state, self.error = self.state, "up", ""
            if was == "down":
                self.known.clear()  # it may have restarted empty
        if was not in ("up", "connecting"):
            log.warning("conversation cache: remote store %s is usable again", self.shown)

    def figures(self) -> RemoteFigures:
        """The tier's gauges (caller holds the lock; its counters live in the journal)."""
        return RemoteFigures(self.shown, self.state, self.error, self.used_bytes, self.max_bytes)

    # ------------------------------------------------------------------ lookup and restore

    def offer(self, toks: np.ndarray, keys: list[str], *, have: int) -> tuple[int, Conv] | None:
        """(tokens it offers, the stored conversation) when the store may offer more of `toks` than the local
        tiers' `have` tokens, else None (engine thread, no lock held)."""
        if len(keys) * self.identity.block_tokens <= have:
            return None
        found = self.lookup(toks, keys)
        if found is None:
            return None
        conv, stored = found
        # no further than what the store was seen to hold: its whole blocks, and its partial one when it ends there
        reach = conv.n_tokens if stored == len(conv.keys) else stored * self.identity.block_tokens
        n = min(common_prefix(toks, conv.tokens), len(toks) - 1, reach)
        if self.identity.state_parts:  # a recurrent state resumes only where one was kept
            with self.lock:
                n = resume_point(self.identity, self.index, conv, n)
        return (n, conv) if n > have else None

    def lookup(self, toks: np.ndarray, keys: list[str]) -> tuple[Conv, int] | None:
        """The stored conversation offering the longest prefix of `keys` and how many of its blocks the store was
        seen to hold (engine thread, no lock held), or None: the manifest that ends at the deepest stored block,
        else the latest one that goes through it (its holder pointer), else that block's prefix alone."""
        if not keys or not self.reachable:
            return None
        try:
            held = self.store.exists("block", keys)
            m = next((i for i, h in enumerate(held) if not h), len(keys))
            found = self._manifest_through(keys, m) if m else None
            stored = m
            if found is not None and len(found[1]) > m:  # the request leaves it inside its block m: is that held?
                stored += self.store.exists("block", [found[1][m]])[0]
        except StoreError as exc:
            self._failed(exc, "looking up")
            return None
        self._succeeded()
        if m == 0:
            with self.lock:
                self.journal.count("remote_misses")
            return None
        b = self.identity.block_tokens
        conv_id, tokens, conv_keys, tail = f"remote-{keys[m - 1][:16]}", toks[: m * b], keys[:m], None
        checkpoints: dict[int, Parts | None] = {}
        states: tuple[int, ...] = ()
        if found is not None:
            manifest, conv_keys = found
            tokens, tail, states = manifest.tokens, manifest.tail, manifest.block_states
            checkpoints = dict(manifest.checkpoints)
            if CONV_ID.fullmatch(manifest.conversation_id):  # another engine's id, shown in events and APIs
                conv_id = manifest.conversation_id
        own = parts_nbytes(tail) + sum(parts_nbytes(p) for p in checkpoints.values())
        conv = Conv(conv_id, tokens, conv_keys, own, tail=tail, checkpoints=checkpoints, created=time.time(),
                    last_used=time.time())
        with self.lock:
            self._remember(keys[:m])
            self._offer(conv, {conv_keys[i] for i in states})
        return conv, stored

    def _manifest_through(self, keys: list[str], m: int) -> tuple[Manifest, list[str]] | None:
        """The manifest ending at block m - 1 of `keys`, else the one its holder pointer names if that goes
        through it; with its block keys. A refused value is counted and removed (StoreError propagates)."""
        last = keys[m - 1]
        value = self.store.get("manifest", [last])[0]
        if value is None:
            pointer = self.store.get("holder", [last])[0]
            if pointer is None or not BLOCK_KEY.fullmatch(pointer.decode(errors="replace")):
                return None
            last = pointer.decode()
            value = self.store.get("manifest", [last])[0]
            if value is None:
                return None
        try:
            manifest = decode_manifest(self.identity, last, value)
        except FileFormatError as exc:
            self._refused("manifest", last, exc)
            return None
        conv_keys = block_keys(self.identity.key, manifest.tokens, self.identity.block_tokens)
        if conv_keys[m - 1] != keys[m - 1]:  # a pointer the conversation it names does not go through: stale
            return None
        return manifest, conv_keys

    def _offer(self, conv: Conv, stated: AbstractSet[str]) -> None:
        """Keep `conv` as an offer (caller holds the lock), replacing one of its id; the oldest unused go.
        `stated`: its blocks the store keeps with the recurrent state at their end (a hybrid model)."""
        idx = self.index
        if conv.id in idx.convs:
            if idx.is_pinned(idx.convs[conv.id]):
                conv.id = f"{conv.id}-{len(idx.convs)}"
            else:
                idx.remove(conv.id)
        for cid in list(idx.convs):
            if len(idx.convs) < MAX_OFFERS:
                break
            if not idx.is_pinned(idx.convs[cid]):
                idx.remove(cid)
        new = [Block(k, self.identity.block_bytes, state=k in stated) for k in conv.keys if k not in idx.blocks]
        idx.add(conv, new)
        for k in stated:
            idx.blocks[k].state = True

    def pieces(self, conv: Conv, blocks: list[Block], use_tail: bool) -> tuple[list[tuple[int, Parts]], int]:
        """The restore's (start, parts) pieces read from the store and the bytes moved (restore reader thread);
        CacheRestoreError for a block gone from the store, refused, or a store that failed. Blocks come in
        batches of FETCH_BLOCKS, the next one on its way while this one is verified, so the engine holds one
        batch of raw values at a time beside the verified parts, and checksums overlap the transfer."""
        keys = [blk.key for blk in blocks]
        batches = [keys[i:i + FETCH_BLOCKS] for i in range(0, len(keys), FETCH_BLOCKS)]
        b, moved = self.identity.block_tokens, 0
        pieces: list[tuple[int, Parts]] = []
        with ThreadPoolExecutor(1, thread_name_prefix="strata-remote-fetch") as fetcher:
            ahead = fetcher.submit(self.store.get, "block", batches[0]) if batches else None
            for n, batch in enumerate(batches):
                assert ahead is not None
                try:
                    values = ahead.result()
                except StoreError as exc:
                    self._failed(exc, "restoring")
                    raise CacheRestoreError(f"the remote store failed ({exc}); prefill instead") from None
                ahead = fetcher.submit(self.store.get, "block", batches[n + 1]) if n + 1 < len(batches) else None
                for key, value in zip(batch, values, strict=True):
                    pieces.append((len(pieces) * b, self._verified(key, value)))
                    moved += len(value or b"")
        if use_tail:
            if conv.tail is None:
                raise CacheRestoreError(f"conversation {conv.id} has no partial block in the store")
            pieces.append((len(conv.keys) * b, conv.tail))
        with self.lock:
            self.journal.count("remote_hits")
            self.journal.count("remote_bytes_got", moved)
        return pieces, moved + parts_nbytes(conv.tail if use_tail else None)

    def _verified(self, key: str, value: bytes | None) -> Parts:
        if value is None:
            raise CacheRestoreError(f"block {key[:12]} left the remote store (evicted or expired); prefill instead")
        try:
            return decode_block(self.identity, key, value)
        except FileFormatError as exc:
            self._refused("block", key, exc)
            raise CacheRestoreError(f"the remote store's block {key[:12]} was refused ({exc}); prefill instead") from None

    def _refused(self, kind: Kind, key: str, exc: FileFormatError) -> None:
        """A damaged, truncated or foreign value: counted, logged, removed (an engine that holds it writes it again)."""
        with self.lock:
            self.journal.count("remote_refused")
            self.known.pop(key, None)
        log.warning("conversation cache: refused the remote store's %s %s (%s): %s", kind, key[:12], exc.reason, exc)
        try:
            self.store.delete(kind, [key])
        except StoreError as err:
            self._failed(err, "removing a refused value")

    def _remember(self, keys: list[str]) -> None:
        for k in keys:
            self.known[k] = None
            self.known.move_to_end(k)
        while len(self.known) > MAX_KNOWN:
            self.known.popitem(last=False)

    # ------------------------------------------------------------------ write-through

    def publish(self, conv_id: str, toks: np.ndarray, keys: list[str], held: dict[str, Parts],
                read_parts: ReadParts, tail: Parts | None, *, filed: AbstractSet[str] = frozenset(),
                load: Callable[[str], bytes] | None = None, checkpoints: dict[int, Parts] | None = None,
                stated: AbstractSet[str] = frozenset()) -> None:
        """Queue a park for the store (engine thread, inside the park: `read_parts` reads the slot). Of the blocks
        the store may lack, `held` are the parts a local tier keeps in RAM (sent by reference), `filed` those
        written on disk (`load(key)` reads the file, on the writer thread, only if the store lacks it); any other
        is copied from the slot. A hybrid model's: `checkpoints` its own, `stated` the blocks a local tier keeps
        with the state at their end."""
        if self._thread is None or not self.reachable:
            if self._thread is not None:
                with self.lock:
                    self.journal.count("remote_dropped")
            return
        b = self.identity.block_tokens
        with self.lock:  # a store coming back may have restarted empty: then everything is sent again
            known = self.known if self.state == "up" else {}
            unknown = [(i, k) for i, k in enumerate(keys) if k not in known]
        try:
            blocks = {k: held[k] if k in held else capture(self.identity, read_parts, i * b, (i + 1) * b)
                      for i, k in unknown if k in held or not (k in filed and load is not None)}
            if len(toks) > len(keys) * b and tail is None:
                tail = capture(self.identity, read_parts, len(keys) * b, len(toks))
        except ParkRefused as exc:  # the slot's state could not be read again: the local park stands
            log.warning("conversation cache: %s not written to the remote store: %s", conv_id, exc)
            with self.lock:
                self.journal.count("remote_dropped")
            return
        state_name = self.identity.state_parts[0].name if self.identity.state_parts else ""
        block_states = [i for i, k in enumerate(keys)  # a block copied from the slot has no state with it
                        if k in stated and (k not in blocks or state_name in blocks[k])]
        job = Upload(conv_id, toks, list(keys), blocks, tail, load, dict(checkpoints or {}), block_states)
        with self._cond:
            while self._queue and self._queued_bytes + job.nbytes > self.queue_bytes:
                old = self._queue.popleft()  # the oldest park: its conversation is likely parked again since
                self._queued_bytes -= old.nbytes
                self.journal.count("remote_dropped")
            self._queue.append(job)
            self._queued_bytes += job.nbytes
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._queue and not self._stopping:
                    self._cond.wait(PROBE_S)
                if not self._queue:
                    if self._stopping:
                        return
                    job = None
                else:
                    job = self._queue.popleft()
                    self._queued_bytes -= job.nbytes
                    self._sending = True
            if job is None:
                self._probe()
                continue
            try:
                if self.reachable:
                    self._send(job)
                else:
                    with self.lock:
                        self.journal.count("remote_dropped")
            finally:
                with self._cond:
                    self._sending = False
                    self._cond.notify_all()

    def _send(self, job: Upload) -> None:
        """Refresh what the store holds of the park, send the rest, then its manifest (writer thread)."""
        s, ident = self.store, self.identity
        try:
            held = s.touch("block", job.keys, self.ttl_s) if job.keys else []
            missing = [k for k, h in zip(job.keys, held, strict=True) if not h]
            items = [(k, value) for k in missing if (value := self._value(job, k)) is not None]
            s.put("block", items, self.ttl_s)
            complete = len(items) == len(missing)  # a block known to the store was evicted since: not whole
            if complete and job.keys:
                manifest = encode_manifest(ident, job.conv_id, job.tokens, job.tail, n_blocks=len(job.keys),
                                           engine_version=self.engine_version, checkpoints=job.checkpoints,
                                           block_states=job.block_states)
                s.put("manifest", [(job.keys[-1], manifest)], self.ttl_s)
                # every earlier block points at it: a request that leaves this conversation inside a later block
                # (an edit, a branch) still finds its tokens and checkpoints there
                s.put("holder", [(k, job.keys[-1].encode()) for k in job.keys[:-1]], self.ttl_s)
                items.append((job.keys[-1], manifest))
        except StoreError as exc:
            self._failed(exc, "writing")
            return
        self._succeeded(wrote=True)
        with self.lock:
            self.journal.count("remote_blocks_put", len(items) - (1 if complete and job.keys else 0))
            self.journal.count("remote_bytes_put", sum(len(v) for _, v in items))
            if complete:
                self._remember(job.keys)
            else:
                for k in missing:
                    self.known.pop(k, None)  # the next park of it captures them again

    def _value(self, job: Upload, key: str) -> bytes | None:
        """A missing block's value: encoded from its parts, or its disk file as it is; None when neither is at
        hand (known to the store when the park was queued, or its file gone since)."""
        if key in job.blocks:
            return encode_block(self.identity, key, job.blocks[key], engine_version=self.engine_version)
        if job.load is None:
            return None
        try:
            return job.load(key)
        except OSError:
            return None

    def drain(self, deadline: float) -> bool:
        """Wait until every queued park is sent (or the deadline passes); True when nothing is left."""
        with self._cond:
            while (self._queue or self._sending) and time.monotonic() < deadline:
                self._cond.wait(max(deadline - time.monotonic(), 0.0))
            return not (self._queue or self._sending)

    def close(self, deadline: float) -> None:
        """Send what is queued until `deadline`, then stop the writer and let the connection go."""
        self.drain(deadline)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(max(deadline - time.monotonic(), 0.1))
        self.store.close()
