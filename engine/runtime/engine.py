"""The engine: slots over preallocated K/V, a request queue, continuous batching, and the conversation cache.

One thread (the engine thread) owns the model, the K/V buffers, the slots and the cache. Everything else talks
to it through `submit` (a generation) and `call`/`run` (any other operation, executed between two steps), so no
lock guards the hot path. Each step runs one forward over every active slot: a prefill chunk for slots still
reading their prompt, one token for slots decoding.

The Engine is composed of objects that each own their state and are handed what they need:

    SlotSet (slot_set.py)        the slots, their K/V buffers and slot memory (memory.py: what a model keeps per
                                 slot beside its K/V, whatever its kind)
    ModelRunner (model_runner.py) one forward on the right threads, the warm-up, the decode mode
    CacheControl (control.py)    the live settings and the conversation cache (which may be off, or start later)
    SlotFiles (slot_files.py)    session files of one slot
    EngineStats (stats.py)       counters, rates, the request log and the published snapshot
    Scheduler (scheduler.py)     the engine thread's loop: admission, park/restore, steps, shutdown

This module builds them (`Engine.from_config` plans devices and loads the model first) and holds the calls any
thread makes; the control calls the server runs on the engine thread are the parts' own methods, named here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import psutil
import torch

from engine.config import EngineConfig, weights_cache_dir
from engine.errors import BadValue, Unavailable
from engine.figures import CacheFigures, EngineFigures
from engine.model import moe_placement
from engine.model.chat_templates import choose_chat_template
from engine.runtime import mtp_drafts
from engine.runtime.control import CacheControl
from engine.runtime.draft_model import DraftModel
from engine.runtime.draft_states import DraftRows, DraftStates, draft_identity, mtp_identity
from engine.runtime.identity import cache_identity, int4_kernel, session_identity
from engine.runtime.memory import slot_memory
from engine.runtime.model_runner import ModelRunner
from engine.runtime.pending_restores import PendingRestores
from engine.runtime.requests import GenerationRequest
from engine.runtime.scheduler import Inbox, Scheduler
from engine.runtime.slot_files import SlotFiles
from engine.runtime.slot_set import SlotSet
from engine.runtime.slot_states import checkpoint_interval
from engine.runtime.speculation import Speculation
from engine.runtime.startup import (
    check_float16,
    check_int4,
    choose_weights_format,
    gpu_weights_format,
    pack_float16,
    quantize_gpu_weights,
)
from engine.runtime.stats import EngineStats
from engine.runtime.stream import RequestStream
from engine.runtime.threads import (
    TORCH_DEFAULT_THREADS,
    StepThreads,
    decode_read_bytes,
    default_decode_threads,
)
from engine.startup_progress import StartupProgress

if TYPE_CHECKING:
    from engine.cache.api import CacheAPI
    from engine.model.build import LoadedModel
    from engine.runtime.protocols import Model, Tokenizer

log = logging.getLogger("strata.engine")
T = TypeVar("T")


class Engine:
    """Serves generation requests on a loaded model; see the module docstring for the threading rule."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel, stages: list[tuple[torch.device, int, int]],
                 progress: StartupProgress | None = None) -> None:
        progress = progress or StartupProgress()
        progress.begin("allocating K/V")
        self.loaded = loaded
        self.model: Model = loaded.model
        self.tokenizer: Tokenizer = loaded.tokenizer
        self.model_name = config.alias or loaded.name
        template, source = choose_chat_template(config.chat_template, loaded.tokenizer.chat_template, loaded.name)
        self.tokenizer.use_chat_template(template)
        self.chat_template_source = source
        self.weights_format = loaded.weights_format
        self.expert_arena_bytes = moe_placement.arena_bytes(self.model.layers)  # 0 for a dense model
        self.int4_kernel = int4_kernel(self.model, self.weights_format)  # asked once: /metrics, the cache identity
        mcfg = loaded.config
        self.ctx_size = min(config.ctx_size, mcfg.max_position_embeddings or config.ctx_size)
        self.tokenizer.limit_prompts(self.ctx_size)
        self.n_slots = config.parallel
        from engine.model.loader import resolve_kv_dtype

        kv_dtype = resolve_kv_dtype(config.kv_dtype, loaded.dtype)
        # What each slot holds beside its K/V (a hybrid's recurrent state, a sliding-window model's windows):
        # engine/runtime/memory.py, the one place that tells the kinds apart.
        every = checkpoint_interval(config.conversation_cache_checkpoint_tokens, config.conversation_cache_block_tokens)
        self.kv, self.memory = slot_memory(self.model, mcfg, self.n_slots, self.ctx_size, kv_dtype, stages, every,
                                           config.conversation_cache_block_tokens)
        self.layout = self.kv.layout
        self.slot_set = SlotSet(self.kv, self.memory, self.ctx_size)
        self.slots = self.slot_set.slots
        compute_threads = config.threads or TORCH_DEFAULT_THREADS
        on_cpu = all(torch.device(d).type == "cpu" for d, _, _ in self.model.stages)
        # --decode-threads 0 on the CPU: start from the rule, then keep timing (engine/runtime/threads.py)
        self.step_threads = StepThreads(compute_threads, config.decode_threads
                                        or default_decode_threads(compute_threads, decode_read_bytes(self.model)),
                                        probe=config.decode_threads == 0 and on_cpu)
        self.runner = ModelRunner(self.model, self.kv, self.memory, self.step_threads)
        self.state = "ok"
        self._closing = threading.Lock()  # close() is called from the signal path and at exit: one does the work
        self._closed = threading.Event()
        # before the cache: its identity names a decode step with its own arithmetic
        self.runner.configure_decode(self.n_slots, cuda_graphs=not config.no_cuda_graphs,
                                     deterministic=config.deterministic)
        self.cache_identity = cache_identity(loaded, self.weights_format, self.int4_kernel, self.layout,
                                             config.conversation_cache_block_tokens, self.memory)
        self.slot_files = SlotFiles(self.slot_set, config.slot_save_path or "", session_identity(self.cache_identity))
        inbox: Inbox = queue.SimpleQueue()
        # reads off this thread; an attention-only model without windows also has its GPU copies issued there
        # (a hybrid's state and a sliding-window model's local rows are written through their own slot writers)
        restores = PendingRestores(wake=lambda: inbox.put(("wake", None)),
                                   kv=self.kv if self.memory.direct_kv else None)
        speculation = Speculation.for_engine(config.spec, config.spec_draft_max, self.memory, self.runner.verify_declines)
        self.draft: DraftModel | None = None
        if speculation.method == "draft" and not speculation.declined:  # a declined draft is not loaded
            self.draft = DraftModel.load(config.model_draft, loaded, self.n_slots, self.ctx_size, kv_dtype,
                                         self.weights_format, device=config.device_draft,
                                         cuda_graphs=not config.no_cuda_graphs)
            speculation = dataclasses.replace(speculation, source=self.draft)
        elif speculation.method == "mtp" and not speculation.declined:
            int4_experts = self.weights_format == "int4"  # the layer's experts held as the model's CPU ones
            why = mtp_drafts.declines(loaded.model, psutil.virtual_memory().available, int4_experts)
            if why:  # declined, not refused: a settings file keeps --spec mtp across models (docs/DETAILS.md)
                log.warning("--spec mtp declined, decoding without drafts: %s", why)
                speculation = dataclasses.replace(speculation, declined=why)
            else:
                speculation = dataclasses.replace(speculation, source=mtp_drafts.MtpSource(
                    loaded.model, self.n_slots, self.ctx_size, int4_experts))
        if config.model_draft and config.spec != "draft":
            log.warning("--model-draft %s is not loaded: it drafts with --spec draft only (--spec is %s)",
                        config.model_draft, config.spec)
        if config.device_draft and not config.model_draft:
            log.warning("--device-draft %s places nothing: there is no --model-draft", config.device_draft)
        progress.begin("building cache index")
        # the draft's own state (a draft model's K/V, the next-token layer's rows) is parked beside the model's
        drafting: DraftRows | None = self.draft
        parked_as = draft_identity(self.draft, config.conversation_cache_block_tokens) if self.draft else None
        if isinstance(speculation.source, mtp_drafts.MtpSource):
            drafting, parked_as = speculation.source, mtp_identity(self.cache_identity, speculation.source)
        self.control = CacheControl(config, self.cache_identity, settle=restores.wait, draft_identity=parked_as)
        self.draft_states = DraftStates(drafting, self.control) if drafting is not None else None
        progress.begin("warming up")
        if self.draft is not None:  # first: the model's warm-up ends measuring the GPU memory left
            self.draft.warm_up()
        self.runner.warm_up(self.ctx_size)

        self.stats = EngineStats(self._collect_stats)
        self.requests = self.stats.requests
        self.scheduler = Scheduler(self.slot_set, self.runner, self.control, restores, self.stats, self.tokenizer,
                                   inbox, speculation, self.draft_states)
        self.stats.publish()
        self._thread = threading.Thread(target=self.scheduler.loop, name="strata-engine", daemon=True)
        self._thread.start()

    @property
    def config(self) -> EngineConfig:
        """The engine's settings as they are now (the live ones change through `update_cache_config`)."""
        return self.control.config

    @property
    def cache(self) -> CacheAPI | None:
        """The conversation cache, or None while it is off."""
        return self.control.cache

    @classmethod
    def from_config(cls, config: EngineConfig, progress: StartupProgress | None = None) -> Engine:
        """Plan devices, load the model and build the engine (raises ModelLoadError / ValueError).

        `progress` follows the start-up phases (GET /health shows them; the log line sums them up)."""
        progress = progress or StartupProgress()
        from engine.model.loader import load_model, read_model_config, resolve_dtype
        from engine.model.planning import layer_bytes, plan_stages

        if config.threads:
            torch.set_num_threads(config.threads)
        progress.begin("reading model file")
        shape = read_model_config(config.model)  # header only; the open GGUF is reused by load_model
        ctx = min(config.ctx_size, shape.max_position_embeddings or config.ctx_size)
        cpu_experts = moe_placement.cpu_expert_layers(shape, config.moe_experts, config.moe_cpu_layers)
        moe_placement.check_cpu_experts(shape, cpu_experts, psutil.virtual_memory().available)
        first = plan_stages(shape.n_layers, config.devices, config.layer_split)
        dtype = resolve_dtype(config.dtype, first[0][0])
        # Planned again with the per-layer size: a device without memory for its layers is refused here.
        stages = plan_stages(shape.n_layers, config.devices, config.layer_split,
                             bytes_per_layer=layer_bytes(shape, dtype, config.parallel, ctx, cpu_experts))
        weights_format = choose_weights_format(config.cpu_weights, dtype, stages)
        if weights_format == "int4":
            check_int4(dtype, stages)  # before the load, which then builds the 4-bit weights as it reads
        elif weights_format == "float16":
            check_float16(dtype, stages)
        gpu_format = gpu_weights_format(config.gpu_weights, dtype, stages)
        progress.begin("loading weights")  # int4 packing included: the 4-bit weights are built as they are read
        # The model builder reports each layer built, the disk tier each file indexed (startup_progress.report).
        with progress.reporting():
            loaded = load_model(config.model, stages, dtype, int4_weights=weights_format == "int4",
                                cpu_experts=cpu_experts,
                                weights_cache_dir=weights_cache_dir() if config.weights_cache == "on" else None)
            if gpu_format == "int4":
                quantize_gpu_weights(loaded)
                weights_format = "int4"
            elif weights_format == "float16":
                pack_float16(loaded)
            loaded.weights_format = weights_format
            engine = cls(config, loaded, stages, progress)
        progress.finish()
        log.info("start-up phases: %s", progress.summary())
        return engine

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
        if self.config.n_predict and (max_tokens is None or max_tokens > self.config.n_predict):
            request.params.max_tokens = max_tokens = self.config.n_predict
        if max_tokens is not None and n + max_tokens > self.ctx_size and self.config.max_tokens_policy == "cap":
            # Agents ask for 32000 tokens whatever the context: generate to the context's end, finish "length".
            request.params.max_tokens = max_tokens = None
        if max_tokens is not None and n + max_tokens > self.ctx_size:
            raise BadValue(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} exceeds the context "
                f"of {self.ctx_size} tokens per slot; lower max_tokens or shorten the prompt "
                "(--max-tokens-policy cap generates up to the context's end instead)",
                param="max_tokens",
            )
        if self.state != "ok":
            raise Unavailable("the engine is shutting down")
        stream = RequestStream(request.request_id)
        self.scheduler.inbox.put(("submit", (request, stream)))
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
        self.scheduler.inbox.put(("call", (fn, future)))
        return future

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Async form of `call` for the server: `await engine.run(engine.purge_cache, "all")`."""
        return await asyncio.wrap_future(self.call(lambda: fn(*args)))

    def close(self, deadline_s: float = 30.0) -> None:
        """Stop taking work, end the requests in flight, park live slots worth keeping (tiered/disk) and shut the
        cache down cleanly. Any thread; a second call waits for the first one's end."""
        with self._closing:
            if self.state != "ok":
                first = False
            else:
                first = True
                self.state = "stopping"
        if not first:
            self._closed.wait(deadline_s + 10)
            return
        try:
            self._close(deadline_s)
        finally:
            self._closed.set()

    def _close(self, deadline_s: float) -> None:
        done = self.call(lambda: self.scheduler.shutdown(deadline_s))
        try:
            done.result(timeout=deadline_s + 5)
        except concurrent.futures.TimeoutError:
            log.warning("shutdown deadline of %.0f s hit; some conversations may not have been saved", deadline_s)
        except Exception:  # a failure while saving must not keep the process from exiting
            log.exception("saving parked conversations at shutdown failed")
        self.scheduler.stop()
        self._thread.join(timeout=5)
        self.state = "stopped"

    # ------------------------------------------------------------------ stats (any thread: the snapshot)

    def stats_snapshot(self) -> dict[str, Any]:
        """The stats the engine thread last published (see EngineStats.snapshot); never waits on a step."""
        return self.stats.snapshot()

    def _collect_stats(self) -> dict[str, Any]:
        """Engine thread: what a stats snapshot holds (EngineStats.publish)."""
        return {
            "engine": self.engine_stats(), "conversation_cache": self.control.figures(),
            "conversations": self.control.conversations(), "events": self.control.events(1 << 30),
            "slots": self.slot_set.info(), "requests": self.requests.snapshot(),
        }

    def engine_stats(self) -> EngineFigures:
        """Engine thread: the engine's figures now (GET /metrics "engine")."""
        stats = self.stats
        drafted, accepted = self.requests.spec_figures()
        return EngineFigures(
            model=self.model_name,
            state=self.state,
            slots=self.n_slots,
            slots_busy=self.slot_set.busy(),
            queued=self.scheduler.queued,
            **stats.counters,
            prefill_tokens_per_s=stats.prefill_rate,
            decode_tokens_per_s=stats.decode_rate,
            uptime_s=time.time() - stats.started_at,
            pid=os.getpid(),
            ctx_size=self.ctx_size,
            kv_bytes=self.kv.nbytes,
            kv_dtype=str(self.kv.layout.dtype).removeprefix("torch."),
            devices=[str(s.device) for s in self.kv.stages],
            weights_format=self.weights_format,
            int4_kernel=self.int4_kernel,
            expert_arena_bytes=self.expert_arena_bytes,  # routed experts resident in host RAM (MoE models)
            threads=self.step_threads.compute,
            decode_threads=self.step_threads.decode_choice,
            omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", "default"),  # read once, when torch loaded
            prefill_reasons=dict(self.requests.reasons),
            spec_break_even=self.scheduler.speculation.break_even(),
            spec_drafted_by_conversation=drafted,
            spec_accepted_by_conversation=accepted,
        )

    # ------------------------------------------------------------------ control calls (engine thread: `run`)

    def slots_info(self) -> list[dict]:
        return self.slot_set.info()

    def save_slot(self, slot_id: int, filename: Any) -> dict:
        return self.slot_files.save(slot_id, filename)

    def restore_slot(self, slot_id: int, filename: Any) -> dict:
        result = self.slot_files.restore(slot_id, filename)
        if self.draft_states is not None:
            self.draft_states.replaced(slot_id)
        return result

    def erase_slot(self, slot_id: int) -> dict:
        result = self.slot_files.erase(slot_id)
        if self.draft_states is not None:
            self.draft_states.replaced(slot_id)
        return result

    def cache_figures(self) -> CacheFigures:
        return self.control.figures()

    def cache_stats(self) -> dict:
        return self.control.figures().to_dict()

    def cache_conversations(self) -> list[dict]:
        return self.control.conversations()

    def cache_events(self, limit: int = 200) -> list[dict]:
        return self.control.events(limit)

    def set_conversation(self, conv_id: str, *, priority: str | None, pinned: bool | None) -> list[dict]:
        return self.control.set_conversation(conv_id, priority=priority, pinned=pinned)

    def drop_conversation(self, conv_id: str) -> dict:
        result = self.control.drop_conversation(conv_id)
        self.scheduler.speculation.forget()  # prompt lookup's recent answers may hold its text
        self._undeliver_forgotten(("ram", "disk"), conv_id)
        return result

    def purge_cache(self, tier: str) -> dict:
        result = self.control.purge(tier)
        self.scheduler.speculation.forget()  # prompt lookup's recent answers hold the purged conversations' text
        self._undeliver_forgotten(("ram", "disk") if tier == "all" else (tier,))
        return result

    def _undeliver_forgotten(self, tiers: tuple[str, ...], conv_id: str | None = None) -> None:
        """Restores read from `tiers` (of `conv_id`, or any) whose conversation is no longer parked after a purge
        or a delete are not delivered: the user asked to forget it. One still being read was skipped (pinned), is
        still parked, and is delivered."""
        cache = self.control.cache
        parked = {c.id for c in cache.conversations()} if cache is not None else set()
        self.scheduler.restores.drop(lambda looked: looked.hit.tier in tiers and looked.hit.conversation_id not in
                                     parked and conv_id in (None, looked.hit.conversation_id))

    def cache_config(self) -> dict:
        return self.control.settings()

    def update_cache_config(self, changes: dict) -> dict:
        return self.control.update(changes)
