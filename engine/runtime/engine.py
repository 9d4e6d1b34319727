"""The engine: slots over preallocated K/V, a request queue, continuous batching, and the conversation cache.

One thread (the engine thread) owns the model, the K/V buffers, the slots and the cache. Everything else talks
to it through `submit` (a generation) and `run` (any other operation, executed between two steps), so no lock
guards the hot path. Each `step` runs one forward over every active slot: a prefill chunk for slots still
reading their prompt, one token for slots decoding.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from engine import __version__
from engine.cache.parts import kv_reader, kv_writer
from engine.config import EngineConfig, setting_of
from engine.errors import BadValue, Busy, NotFound, Refused, Unavailable
from engine.kv import KVBuffers, KVLayout
from engine.runtime.requests import GenerationRequest, TokenEvent, Usage
from engine.runtime.sampling import Sampler
from engine.runtime.stop_strings import StopStringFilter
from engine.runtime.stream import RequestStream

if TYPE_CHECKING:
    from engine.cache.api import CacheAPI
    from engine.cache.identity import CacheIdentity
    from engine.cache.stats import CacheHit

log = logging.getLogger("strata.engine")
T = TypeVar("T")

# A conversation shorter than this is cheaper to prefill again than to park; a hit that saves fewer tokens than
# this over the live slot is not worth parking the slot's conversation for.
MIN_PARK_TOKENS = 16
# While steps run back to back the stats snapshot is refreshed at most this often (and at every request's end).
STATS_INTERVAL_S = 0.1


@dataclass(slots=True)
class Active:
    """A request occupying a slot."""

    request: GenerationRequest
    stream: RequestStream
    sampler: Sampler
    stops: StopStringFilter
    decoder: Any  # the tokenizer's StreamDecoder
    cached_tokens: int
    max_tokens: int
    generated: list[int] = field(default_factory=list)
    next_token: int | None = None  # sampled, not yet fed through the model


@dataclass(slots=True)
class Slot:
    """One row of the K/V buffers and what is in it."""

    id: int
    tokens: list[int] = field(default_factory=list)  # tokens whose K/V rows [0, len) are valid
    active: Active | None = None
    last_used: float = 0.0
    prompt: list[int] = field(default_factory=list)  # the active request's prompt (prefill target)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    ta = torch.tensor(a[:n], dtype=torch.int64)
    tb = torch.tensor(b[:n], dtype=torch.int64)
    diff = (ta != tb).nonzero()
    return int(diff[0].item()) if diff.numel() else n


class Engine:
    """Serves generation requests on a loaded model; see the module docstring for the threading rule."""

    def __init__(self, config: EngineConfig, loaded: Any, stages: list[tuple[torch.device, int, int]]) -> None:
        self.config = config
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.model_name = config.alias or loaded.name
        self.weights_format = getattr(loaded, "weights_format", "float")
        mcfg = loaded.config
        self.ctx_size = min(config.ctx_size, mcfg.max_position_embeddings or config.ctx_size)
        self.n_slots = config.parallel
        self.layout = KVLayout(mcfg.n_layers, mcfg.n_kv_heads, mcfg.head_dim, loaded.dtype)
        self.kv = KVBuffers(self.layout, self.n_slots, self.ctx_size, stages)
        self.slots = [Slot(i) for i in range(self.n_slots)]
        self.started_at = time.time()
        self.state = "ok"
        self.cache_identity: CacheIdentity | None = None
        self.cache: CacheAPI | None = self._make_cache(config)
        self._warm_up()

        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._waiting: list[tuple[GenerationRequest, RequestStream]] = []
        self._stop = threading.Event()
        self._counters = {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0}
        self._prefill_rate: float | None = None  # tokens/s, smoothed
        self._decode_rate: float | None = None
        self._stats: dict[str, Any] = {}  # replaced whole by the engine thread, never mutated: see stats_snapshot
        self._publish_stats()
        self._thread = threading.Thread(target=self._loop, name="strata-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ construction

    def _warm_up(self) -> None:
        """One short prefill and one decode step before serving, so the first request (often a conversation
        resumed after a restart) does not pay the kernels' one-time set-up."""
        from engine.model.llama import SeqChunk

        with torch.inference_mode():
            prompt = torch.zeros(min(8, self.ctx_size - 1), dtype=torch.int64)
            self.model.forward_chunks([SeqChunk(0, 0, prompt)], self.kv)
            self.model.forward_chunks([SeqChunk(0, len(prompt), prompt[:1])], self.kv)
        self.kv.clear(0)

    @classmethod
    def from_config(cls, config: EngineConfig) -> Engine:
        """Plan devices, load the model and build the engine (raises ModelLoadError / ValueError)."""
        from engine.model.loader import load_model, read_model_config, resolve_dtype
        from engine.model.planning import layer_bytes, plan_stages

        if config.threads:
            torch.set_num_threads(config.threads)
        t0 = time.perf_counter()
        shape = read_model_config(config.model)  # header only; the open GGUF is reused by load_model
        ctx = min(config.ctx_size, shape.max_position_embeddings or config.ctx_size)
        first = plan_stages(shape.n_layers, config.devices, config.layer_split)
        dtype = resolve_dtype(config.dtype, first[0][0])
        # Planned again with the per-layer size: a device without memory for its layers is refused here.
        stages = plan_stages(shape.n_layers, config.devices, config.layer_split,
                             bytes_per_layer=layer_bytes(shape, dtype, config.parallel, ctx))
        weights_format = _weights_format(config.cpu_weights, dtype, stages)
        if weights_format == "int4":
            _check_int4(dtype, stages)  # before the load, which then builds the 4-bit weights as it reads
        t1 = time.perf_counter()
        loaded = load_model(config.model, stages, dtype, int4_weights=weights_format == "int4")
        loaded.weights_format = weights_format
        t2 = time.perf_counter()
        engine = cls(config, loaded, stages)
        log.info("start-up phases: header %.2f s, weights (int4 packing included) %.2f s, K/V + cache + warm-up %.2f s",
                 t1 - t0, t2 - t1, time.perf_counter() - t2)
        return engine

    def _make_cache(self, config: EngineConfig) -> CacheAPI | None:
        off = config.conversation_cache_storage == "ram" and config.conversation_cache_mib == 0
        if off:
            log.info("conversation cache off (--conversation-cache-mib 0)")
            return None
        from engine.cache import CacheSettings, ConversationCache

        return ConversationCache(CacheSettings.from_engine_config(config), self._identity(),
                                 engine_version=__version__)

    # ------------------------------------------------------------------ public API (any thread)

    def submit(self, request: GenerationRequest) -> RequestStream:
        """Queue a generation; events arrive on the returned stream. Refuses what cannot fit a slot."""
        n = len(request.prompt_tokens)
        if n == 0:
            raise BadValue("the prompt is empty: expected at least one token", param="prompt")
        if n >= self.ctx_size:
            raise BadValue(
                f"the prompt has {n} tokens but the context holds {self.ctx_size} per slot; shorten the prompt",
                param="messages",
            )
        max_tokens = request.params.max_tokens
        if max_tokens is not None and n + max_tokens > self.ctx_size:
            raise BadValue(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} exceeds the context "
                f"of {self.ctx_size} tokens per slot; lower max_tokens or shorten the prompt",
                param="max_tokens",
            )
        if self.state != "ok":
            raise Unavailable("the engine is shutting down")
        stream = RequestStream(request.request_id)
        self._inbox.put(("submit", (request, stream)))
        return stream

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run `fn` on the engine thread between steps; the future carries its result or exception."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        if threading.current_thread() is self._thread:
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                future.set_exception(exc)
            return future
        self._inbox.put(("call", (fn, future)))
        return future

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Async form of `call` for the server: `await engine.run(engine.purge_cache, "all")`."""
        return await asyncio.wrap_future(self.call(lambda: fn(*args)))

    def stats_snapshot(self) -> dict[str, Any]:
        """The stats the engine thread last published (any thread, never waits on a step): "engine",
        "conversation_cache", "conversations", "events", "slots". Published at each request's end, after each
        `call`, and every STATS_INTERVAL_S while steps run, so a step of any length never delays a stats reader."""
        snap = self._stats
        engine = {**snap["engine"], "uptime_s": time.time() - self.started_at,
                  "stats_age_s": time.monotonic() - snap["published"]}
        return {**snap, "engine": engine}

    def _publish_stats(self) -> None:
        """Engine thread: a fresh copy of what the stats routes serve (a failure here never stops the loop)."""
        try:
            self._stats = {
                "engine": self.engine_stats(), "conversation_cache": self.cache_stats(),
                "conversations": self.cache_conversations(), "events": self.cache_events(1 << 30),
                "slots": self.slots_info(), "published": time.monotonic(),
            }
        except Exception:
            log.exception("publishing the stats snapshot failed; serving the previous one")

    def close(self, deadline_s: float = 30.0) -> None:
        """Stop taking work, park live slots worth keeping (tiered/disk) and shut the cache down cleanly."""
        if self.state == "stopped":
            return
        self.state = "stopping"
        done = self.call(lambda: self._shutdown(deadline_s))
        try:
            done.result(timeout=deadline_s + 5)
        except concurrent.futures.TimeoutError:
            log.warning("shutdown deadline of %.0f s hit; some conversations may not have been saved", deadline_s)
        except Exception:  # a failure while saving must not keep the process from exiting
            log.exception("saving parked conversations at shutdown failed")
        self._stop.set()
        self._inbox.put(("wake", None))
        self._thread.join(timeout=5)
        self.state = "stopped"

    # ------------------------------------------------------------------ operations run on the engine thread

    def slots_info(self) -> list[dict]:
        return [
            {
                "id": s.id,
                "state": "busy" if s.active else "idle",
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
        if slot.active is not None:
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
        from engine.cache.session_file import save_session

        slot = self._slot_for_file_op(slot_id)
        path = self._session_path(filename)
        if not slot.tokens:
            raise BadValue(f"slot {slot_id} is empty: nothing to save", param="id")
        os.makedirs(self.config.slot_save_path or ".", exist_ok=True)
        t0 = time.perf_counter()
        n = len(slot.tokens)
        nbytes = save_session(path, self._identity(), slot.tokens, self.kv.read(slot.id, 0, n), engine_version=__version__)
        ms = (time.perf_counter() - t0) * 1000
        log.info("slot %d saved to %s: %d tokens, %d bytes, %.1f ms", slot_id, os.path.basename(path), n, nbytes, ms)
        return {"id_slot": slot_id, "filename": os.path.basename(path), "n_saved": n, "n_written": nbytes,
                "timings": {"save_ms": ms}}

    def restore_slot(self, slot_id: int, filename: Any) -> dict:
        from engine.cache.session_file import SessionFileError, load_session

        slot = self._slot_for_file_op(slot_id)
        path = self._session_path(filename)
        if not os.path.isfile(path):
            raise NotFound(f"no session file named {os.path.basename(path)!r} in the slot save path", param="filename")
        t0 = time.perf_counter()
        try:
            tokens, kv = load_session(path, self._identity())
        except SessionFileError as exc:
            raise BadValue(f"{os.path.basename(path)}: {exc}", param="filename") from exc
        if len(tokens) > self.ctx_size:
            raise BadValue(f"the file holds {len(tokens)} tokens but a slot holds {self.ctx_size}", param="filename")
        self._write_slot(slot, tokens, kv)
        ms = (time.perf_counter() - t0) * 1000
        log.info("slot %d restored from %s: %d tokens, %.1f ms", slot_id, os.path.basename(path), len(tokens), ms)
        return {"id_slot": slot_id, "filename": os.path.basename(path), "n_restored": len(tokens),
                "n_read": int(kv.nbytes), "timings": {"restore_ms": ms}}

    def erase_slot(self, slot_id: int) -> dict:
        slot = self._slot_for_file_op(slot_id)
        n = len(slot.tokens)
        slot.tokens = []
        self.kv.clear(slot.id)
        return {"id_slot": slot_id, "n_erased": n}

    def _write_slot(self, slot: Slot, tokens: list[int], kv: torch.Tensor) -> None:
        slot.tokens = []
        try:
            self.kv.write(slot.id, 0, kv)
        except BaseException:
            self.kv.clear(slot.id)
            raise
        slot.tokens = list(tokens)

    def _identity(self) -> CacheIdentity:
        """What parked K/V and session files must match to be restored here (block size is fixed at start)."""
        if self.cache_identity is None:
            from engine.cache import CacheIdentity

            self.cache_identity = CacheIdentity(
                model={
                    **self.loaded.config.describe(),
                    "weights": self.loaded.fingerprint,
                    "weights_format": self.weights_format,  # int4 weights give other K/V than float ones
                    "tokenizer": self.tokenizer.fingerprint,
                },
                layout=self.layout,
                block_tokens=self.config.conversation_cache_block_tokens,
            )
        return self.cache_identity

    def engine_stats(self) -> dict:
        busy = sum(1 for s in self.slots if s.active)
        return {
            "model": self.model_name,
            "state": self.state,
            "slots": self.n_slots,
            "slots_busy": busy,
            "queued": len(self._waiting),
            **self._counters,
            "prefill_tokens_per_s": self._prefill_rate,
            "decode_tokens_per_s": self._decode_rate,
            "uptime_s": time.time() - self.started_at,
            "pid": os.getpid(),
            "ctx_size": self.ctx_size,
            "kv_bytes": self.kv.nbytes,
            "devices": [str(s.device) for s in self.kv.stages],
            "weights_format": self.weights_format,
            "threads": torch.get_num_threads(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),  # read once, when torch loaded
        }

    def cache_stats(self) -> dict:
        if self.cache is None:
            return {"enabled": False, "storage": self.config.conversation_cache_storage}
        return self.cache.stats().to_dict()

    def cache_conversations(self) -> list[dict]:
        if self.cache is None:
            return []
        return [c.to_dict() for c in self.cache.conversations()]

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

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        with torch.inference_mode():
            while not self._stop.is_set():
                idle = not self._waiting and all(s.active is None for s in self.slots)
                self._drain_inbox(block=idle)
                if self._stop.is_set():
                    break
                self._drop_cancelled()
                self._admit_waiting()
                if any(s.active is not None for s in self.slots):
                    try:
                        self._step()
                    except Exception as exc:  # a bug must not hang clients: fail their requests, keep serving
                        log.exception("engine step failed")
                        self._fail_active(f"internal error: {exc}")
                if time.monotonic() - self._stats["published"] >= STATS_INTERVAL_S:
                    self._publish_stats()

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload = item
            if kind == "submit":
                self._waiting.append(payload)
            elif kind == "call":
                fn, future = payload
                if future.set_running_or_notify_cancel():
                    try:
                        result = fn()
                    except BaseException as exc:  # noqa: BLE001 - handed to the caller
                        self._publish_stats()
                        future.set_exception(exc)
                    else:
                        self._publish_stats()  # before the caller hears back, so its next stats read sees the change
                        future.set_result(result)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _drop_cancelled(self) -> None:
        kept = []
        for request, stream in self._waiting:
            if stream.cancelled.is_set():
                stream.put(TokenEvent(finish_reason="stop", usage=Usage(len(request.prompt_tokens), 0, 0)))
            else:
                kept.append((request, stream))
        self._waiting = kept
        for slot in self.slots:
            if slot.active is not None and slot.active.stream.cancelled.is_set():
                log.info("request %s cancelled by the client; slot %d freed", slot.active.request.request_id, slot.id)
                self._finish(slot, "stop")

    def _fail_active(self, message: str) -> None:
        for slot in self.slots:
            if slot.active is not None:
                a = slot.active
                a.stream.put(TokenEvent(finish_reason="error", error=message,
                                        usage=Usage(len(a.request.prompt_tokens), len(a.generated), a.cached_tokens)))
                slot.active = None
                # What the failed step wrote is unknown: forget the slot's contents.
                slot.tokens = []

    # ------------------------------------------------------------------ admission: slot choice + cache

    def _admit_waiting(self) -> None:
        admitted = False
        while self._waiting:
            free = [s for s in self.slots if s.active is None]
            if not free:
                break
            request, stream = self._waiting.pop(0)
            admitted = True
            try:
                self._admit(request, stream, free)
            except Exception as exc:
                log.exception("could not start request %s", request.request_id)
                stream.put(TokenEvent(finish_reason="error", error=f"internal error: {exc}",
                                      usage=Usage(len(request.prompt_tokens), 0, 0)))
        if admitted:  # the next step may be long: show the busy slots and restores before it
            self._publish_stats()

    def _admit(self, request: GenerationRequest, stream: RequestStream, free: list[Slot]) -> None:
        prompt = request.prompt_tokens
        usable = len(prompt) - 1  # the last prompt token is always computed: its logits pick the first output
        # The free slot whose live contents reuse the most of this prompt.
        live = {s.id: min(common_prefix(s.tokens, prompt), usable) for s in free}
        best = max(free, key=lambda s: (live[s.id], -s.last_used))
        hit = None
        if self.cache is not None:
            hit = self.cache.lookup(prompt, live_prefix=live[best.id])
            if hit is not None and hit.n_tokens - live[best.id] < MIN_PARK_TOKENS:
                hit = None
            if hit is None and live[best.id] < usable:
                self.cache.record_miss()
        if hit is not None:
            # Restore into the least recently used free slot, parking what it holds.
            slot = min(free, key=lambda s: (len(s.tokens) > 0, s.last_used))
            reused = self._restore_hit(slot, hit, prompt)
        else:
            slot = best if live[best.id] > 0 else min(free, key=lambda s: (len(s.tokens) > 0, s.last_used))
            reused = live[slot.id]
            self._park_if_losing(slot, reused)
            slot.tokens = slot.tokens[:reused]

        max_tokens = request.params.max_tokens or (self.ctx_size - len(prompt))
        slot.prompt = list(prompt)
        slot.active = Active(
            request=request,
            stream=stream,
            sampler=Sampler(request.params, prompt),
            stops=StopStringFilter(request.params.stop),
            decoder=self.tokenizer.stream_decoder(),
            cached_tokens=reused,
            max_tokens=max_tokens,
        )
        slot.last_used = time.time()
        stream.mark_started()
        self._counters["requests"] += 1
        self._counters["prompt_tokens"] += len(prompt)
        self._counters["cached_tokens"] += reused

    def _park_if_losing(self, slot: Slot, keep: int, protect: str | None = None) -> None:
        """Park the slot's conversation if reusing only `keep` of its tokens would throw the rest away.

        `protect` names a parked conversation this park must not evict (the hit about to be restored).
        """
        if self.cache is None or len(slot.tokens) <= keep or len(slot.tokens) < MIN_PARK_TOKENS:
            return
        self._park(slot, protect)

    def _park(self, slot: Slot, protect: str | None = None) -> None:
        assert self.cache is not None
        tokens = list(slot.tokens)
        try:
            result = self.cache.park(tokens, kv_reader(lambda a, b: self.kv.read(slot.id, a, b)), keep=protect)
        except Exception:  # the cache must never take a request down
            log.exception("parking slot %d failed", slot.id)
            return
        if not result.parked:
            log.info("slot %d: %d tokens not parked: %s", slot.id, len(tokens), result.reason)

    def _restore_hit(self, slot: Slot, hit: CacheHit, prompt: list[int]) -> int:
        """Park the slot's contents, then restore `hit` into it; on any failure the slot is a clean miss."""
        assert self.cache is not None
        self._park_if_losing(slot, 0, protect=hit.conversation_id)
        slot.tokens = []
        try:
            result = self.cache.restore(
                hit, kv_writer(lambda start, data: self._write_queued(slot, start, data, hit.n_tokens))
            )
        except Exception as exc:
            log.warning("restore of conversation %s failed, prefilling instead: %s", hit.conversation_id, exc)
            self.kv.clear(slot.id)
            return 0
        n = min(result.n_tokens, len(prompt) - 1)
        slot.tokens = list(prompt[:n])
        return n

    def _write_queued(self, slot: Slot, start: int, data: torch.Tensor, end: int) -> None:
        """Queue a restored piece into the slot; wait for all transfers once the last piece is queued."""
        self.kv.write(slot.id, start, data, wait=False)
        if start + data.shape[2] >= end:
            self.kv.synchronize()

    # ------------------------------------------------------------------ one forward step

    def _step(self) -> None:
        from engine.model.llama import SeqChunk

        chunks: list[SeqChunk] = []
        owners: list[tuple[Slot, bool]] = []  # (slot, produces a token this step)
        n_prefill = n_decode = 0
        for slot in self.slots:
            a = slot.active
            if a is None:
                continue
            pos = len(slot.tokens)
            if a.next_token is not None:  # decoding: feed the last sampled token
                chunks.append(SeqChunk(slot.id, pos, torch.tensor([a.next_token], dtype=torch.int64)))
                owners.append((slot, True))
                n_decode += 1
            else:  # prefilling the prompt, one chunk per step
                end = _prefill_end(pos, len(slot.prompt), self.config.prefill_chunk)
                chunks.append(SeqChunk(slot.id, pos, torch.tensor(slot.prompt[pos:end], dtype=torch.int64)))
                owners.append((slot, end == len(slot.prompt)))
                n_prefill += end - pos
        t0 = time.perf_counter()
        logits = self.model.forward_chunks(chunks, self.kv)
        dt = time.perf_counter() - t0
        self._note_rates(n_prefill, n_decode, dt)

        for i, (slot, produces) in enumerate(owners):
            a = slot.active
            assert a is not None
            chunk = chunks[i]
            slot.tokens.extend(chunk.tokens.tolist())
            if not produces:
                continue
            token = a.sampler.sample(logits[i])
            self._emit(slot, token)

    def _note_rates(self, n_prefill: int, n_decode: int, dt: float) -> None:
        if dt <= 0:
            return
        if n_prefill >= 32 and n_decode == 0:
            rate = n_prefill / dt
            self._prefill_rate = rate if self._prefill_rate is None else 0.7 * self._prefill_rate + 0.3 * rate
            if self.cache is not None:
                self.cache.prefill_tokens_per_s = self._prefill_rate
        elif n_prefill == 0 and n_decode > 0:
            rate = n_decode / dt
            self._decode_rate = rate if self._decode_rate is None else 0.9 * self._decode_rate + 0.1 * rate

    def _emit(self, slot: Slot, token: int) -> None:
        a = slot.active
        assert a is not None
        a.generated.append(token)
        self._counters["generated_tokens"] += 1
        is_eos = token in self.tokenizer.eos_token_ids and not a.request.params.ignore_eos
        if is_eos:
            self._finish(slot, "stop")
            return
        text = a.stops.push(a.decoder.push(token))
        if a.stops.stopped:
            if text:
                a.stream.put(TokenEvent(text=text, token_id=token))
            a.next_token = token
            self._finish(slot, "stop")
            return
        a.stream.put(TokenEvent(text=text, token_id=token))
        a.next_token = token
        if len(a.generated) >= a.max_tokens or len(slot.tokens) + 1 >= self.ctx_size:
            self._finish(slot, "length")

    def _finish(self, slot: Slot, reason: str) -> None:
        a = slot.active
        assert a is not None
        tail = "" if a.stops.stopped else a.stops.push(a.decoder.flush()) + a.stops.flush()
        usage = Usage(len(a.request.prompt_tokens), len(a.generated), a.cached_tokens)
        slot.active = None
        slot.last_used = time.time()
        self._publish_stats()  # before the client hears the end, so its next stats read counts this request
        a.stream.put(TokenEvent(text=tail, finish_reason=reason, usage=usage))

    # ------------------------------------------------------------------ shutdown

    def _shutdown(self, deadline_s: float) -> None:
        for slot in self.slots:
            if slot.active is not None:
                self._finish(slot, "stop")
        for request, stream in self._waiting:
            stream.put(TokenEvent(finish_reason="error", error="the engine is shutting down",
                                  usage=Usage(len(request.prompt_tokens), 0, 0)))
        self._waiting = []
        if self.cache is None:
            return
        keeps = self.config.conversation_cache_storage in ("tiered", "disk")
        if keeps:
            for slot in self.slots:
                if len(slot.tokens) >= MIN_PARK_TOKENS:
                    self._park(slot)
        self.cache.close(spill=keeps, deadline_s=deadline_s)


def _prefill_end(pos: int, n_prompt: int, chunk: int) -> int:
    """End of the next prefill chunk from `pos`: at most `chunk` tokens, and the prompt's last token alone.

    A token's K/V and logits depend in their last bits on the chunk that computes it (attention kernels tile
    by sequence length; a lone token takes another path than a row of a chunk). A prompt whose K/V is all
    present again (a conversation restored after a restart, the same turn asked again, a slot that kept it)
    recomputes only its last token, alone. Computing that token alone the first time too makes the logits
    that pick the first output, and so a greedy continuation, identical whichever way the rest was chunked.
    """
    assert 0 <= pos < n_prompt and chunk > 0, (pos, n_prompt, chunk)
    last = n_prompt - 1
    if pos == last:
        return n_prompt
    return min(last, pos + chunk)


def _weights_format(choice: str, dtype: torch.dtype, stages: list[tuple[torch.device, int, int]]) -> str:
    """The effective --cpu-weights: auto means int4 where it applies (CPU, float32, kernels present)."""
    if choice != "auto":
        return choice
    from engine.model import int4

    on_cpu = all(torch.device(d).type == "cpu" for d, _, _ in stages)
    return "int4" if on_cpu and dtype == torch.float32 and int4.available() else "float"


def _check_int4(dtype: torch.dtype, stages: list[tuple[torch.device, int, int]]) -> None:
    """ValueError when `--cpu-weights int4` cannot apply."""
    from engine.model import int4

    if any(torch.device(d).type != "cpu" for d, _, _ in stages):
        raise ValueError("--cpu-weights int4: only for models on the CPU; use --cpu-weights float with --devices cuda")
    if dtype != torch.float32:
        raise ValueError("--cpu-weights int4: needs --dtype float32 (or auto) on the CPU")
    if not int4.available():
        raise ValueError(f"--cpu-weights int4: this PyTorch ({torch.__version__}) has no CPU int4 kernels")
