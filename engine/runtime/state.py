"""What the engine holds: its slots, the request in each, and the attributes every part of the Engine reads.

The Engine is built in layers, each a module of its own (state -> startup -> control -> stats -> scheduler ->
engine): a layer may call what the layers below it define, and all of them read the attributes declared here,
which `Engine.__init__` sets.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.cache.attrs import DEFAULT_PRIORITY, NO_ATTRS, ConvAttrs
from engine.config import EngineConfig
from engine.kv import KVBuffers, KVLayout
from engine.runtime.requests import GenerationRequest
from engine.runtime.sampling import Sampler
from engine.runtime.stop_strings import StopStringFilter
from engine.runtime.stream import RequestStream

if TYPE_CHECKING:
    from engine.cache.api import CacheAPI
    from engine.cache.identity import CacheIdentity
    from engine.runtime.explain import RequestLog
    from engine.runtime.memory import SlotMemory
    from engine.runtime.pending_restores import PendingRestores
    from engine.runtime.threads import StepThreads

log = logging.getLogger("strata.engine")


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
    # the conversation it holds: what its last request said (handed to the cache when it is parked) and the
    # priority and pin that decide how cheap it is to displace (engine.runtime.slot_choice)
    attrs: ConvAttrs = NO_ATTRS
    priority: str = DEFAULT_PRIORITY
    pinned: bool = False
    conversation_id: str | None = None  # the parked conversation its contents continue, once parked
    unnamed: list[str] = field(default_factory=list)  # ids of requests it served before that id was known
    restoring: bool = False  # waiting for a restore's read (engine.runtime.pending_restores): not free, not stepped


class EngineState:
    """The attributes `Engine.__init__` sets, declared once for the layers that read them."""

    config: EngineConfig
    loaded: Any  # a LoadedModel (engine.model), with weights_format set by Engine.from_config
    model: Any
    tokenizer: Any
    model_name: str
    weights_format: str
    _int4_kernel_name: str  # "blocks", "aten" or "" (engine/runtime/startup.py, int4_kernel)
    expert_arena_bytes: int  # routed experts resident in host RAM (engine/model/moe_placement.py)
    ctx_size: int
    n_slots: int
    layout: KVLayout
    kv: KVBuffers
    memory: SlotMemory  # what each slot holds beside its K/V (engine/runtime/memory.py)
    slots: list[Slot]
    step_threads: StepThreads  # torch's threads per kind of step (engine/runtime/threads.py)
    started_at: float
    state: str
    cache_identity: CacheIdentity | None
    cache: CacheAPI | None
    _inbox: queue.SimpleQueue[tuple[str, Any]]
    _waiting: list[tuple[GenerationRequest, RequestStream]]
    _stop: threading.Event
    _counters: dict[str, int]
    _prefill_rate: float | None
    _decode_rate: float | None
    _stats: dict[str, Any]
    requests: RequestLog
    _restores: PendingRestores
    _thread: threading.Thread
