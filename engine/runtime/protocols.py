"""What the runtime needs of a model and of a tokenizer, as Protocols: a dense or MoE `CausalLM`
(engine/model/llama.py) and a hybrid `HybridCausalLM` (engine/model/hybrid/model.py) are both a `Model`; the
runtime never asks which one it holds (what differs lives in its slot memory, engine/runtime/memory.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch


class Model(Protocol):
    """A decoder-only model split into stages of layers over devices."""

    stages: list[tuple[torch.device, int, int]]  # (device, first layer, end layer)
    layers: torch.nn.ModuleList
    lm_head: Any

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def forward_chunks(self) -> Callable[..., Any]:
        """forward_chunks(chunks: list[SeqChunk], kv: KVBuffers, *memory) -> float32 logits, one row per chunk;
        `memory` is what the slot memory hands beside the K/V (SlotMemory.forward_args: a hybrid's state)."""
        ...

    @property
    def own_decode_arithmetic(self) -> bool:
        """Decoded tokens' K/V come from the native step's arithmetic (part of the cache identity)."""
        ...

    def warm_up_batches(self) -> list[int]:
        """The batch sizes whose decode step runs once before serving (captured CUDA graphs)."""
        ...

    def rope_tables(self) -> list[Any]:
        """Every RoPE table the forward reads (engine/model/rope.py RotaryTable), built for the whole context."""
        ...

    def modules(self) -> Iterator[torch.nn.Module]: ...


class StreamDecoder(Protocol):
    def push(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class Tokenizer(Protocol):
    """Text to tokens and back, the chat template, and what identifies it."""

    fingerprint: str
    eos_token_ids: frozenset[int]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def stream_decoder(self, skip_special_tokens: bool = True) -> StreamDecoder: ...

    def use_chat_template(self, template: str) -> None: ...

    def limit_prompts(self, context_tokens: int) -> None: ...


if TYPE_CHECKING:  # both kinds of model are a Model, as the type checker sees them
    from engine.model.hybrid.model import HybridCausalLM
    from engine.model.llama import CausalLM
    from engine.model.tokenizer import Tokenizer as ModelTokenizer

    def _conforms(dense: CausalLM, hybrid: HybridCausalLM, tokenizer: ModelTokenizer) -> tuple[Model, Model, Tokenizer]:
        return dense, hybrid, tokenizer
