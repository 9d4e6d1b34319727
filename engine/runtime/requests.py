"""What the server hands the engine, and what the engine streams back. Plain data, no behaviour."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.cache.attrs import NO_ATTRS, ConvAttrs


@dataclass(slots=True)
class SamplingParams:
    """Validated sampling settings of one request (the server checks ranges before building this)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repeat_penalty: float = 1.0  # llama.cpp-style multiplicative penalty over the last `repeat_last_n` tokens
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None  # None = until the context is full
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1


@dataclass(slots=True)
class GenerationRequest:
    """One completion to run: prompt token ids plus how to sample."""

    request_id: str
    prompt_tokens: list[int]
    params: SamplingParams
    attrs: ConvAttrs = NO_ATTRS  # its conversation's priority, pin, name and client (metadata / X-Strata-*)
    # The first token the chat template wrote otherwise than at the conversation's earlier turns (None: it only
    # appended); a prompt leaving its cached candidate there is explained as the template's doing.
    rewritten_at: int | None = None
    # Earlier turns' reasoning the chat format left out or kept, and its tokens (RequestRecord.past_reasoning)
    past_reasoning: dict[str, Any] | None = None


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens not recomputed: live-slot reuse plus conversation-cache restores


@dataclass(slots=True)
class TokenEvent:
    """One step of a stream: new text (may be empty while a UTF-8 sequence or stop string is pending).

    The last event of a request has `finish_reason` ("stop" or "length"), `usage`, and `stop_string` when a
    stop string ended it; an engine-side failure
    ends the stream with finish_reason "error" and `error` set.
    """

    text: str = ""
    token_id: int | None = None
    finish_reason: str | None = None
    usage: Usage | None = None
    error: str | None = None
    stop_string: str | None = None  # on the last event: the stop string that ended generation, if one did
    generated: list[int] | None = None  # on the last event: every token id generated (a final end-of-turn included)
