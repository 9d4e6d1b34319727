"""A slot and the request it serves (engine/runtime/slot_set.py holds the slots)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.cache.attrs import DEFAULT_PRIORITY, NO_ATTRS, ConvAttrs
from engine.runtime.requests import GenerationRequest
from engine.runtime.sampling import Sampler
from engine.runtime.stop_strings import StopStringFilter
from engine.runtime.stream import RequestStream

if TYPE_CHECKING:
    from engine.runtime.protocols import StreamDecoder
    from engine.runtime.speculation import Drafts


@dataclass(slots=True)
class Active:
    """A request occupying a slot."""

    request: GenerationRequest
    stream: RequestStream
    sampler: Sampler
    stops: StopStringFilter
    decoder: StreamDecoder
    cached_tokens: int
    max_tokens: int
    generated: list[int] = field(default_factory=list)
    next_token: int | None = None  # sampled, not yet fed through the model
    drafter: Drafts | None = None  # --spec: its draft tokens (engine/runtime/speculation.py)


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
