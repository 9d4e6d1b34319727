"""What a slot holds beside its attention K/V rows, behind one interface the runtime talks to whatever the model.

The slot's K/V buffers (engine.kv) hold every attention layer's rows; a model may keep more per slot, and what it
keeps decides how much of a slot's contents a new prompt can reuse, what the cache parks and how a restore or a
session file is written back:
- `AttentionMemory`: nothing more (a dense or mixture-of-experts model with full attention).
- `WindowMemory`: a sliding-window model; the cache parks its local layers' last window only, so a slot restored
  from one holds local rows of its own only from its floor on (engine/runtime/windows.py).
- `RecurrentMemory`: a hybrid model's recurrent state and its checkpoints (engine/runtime/slot_states.py), which
  cannot be cut back to any prefix the way K/V rows can.

In the shape of llama.cpp's `llama_memory_i` (clear, keep a prefix, state write/read): the scheduler, the control
calls and the start-up ask the memory and never which kind of model they serve. A draft model's K/V or an MTP
layer's state is one more implementation beside these (a composite of two).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from engine.cache.parts import Parts, ReadParts, WriteParts, kv_reader, kv_writer
from engine.errors import BadValue
from engine.kv import KVBuffers, KVLayout
from engine.runtime.slot_states import SlotStates, hybrid_buffers
from engine.runtime.windows import SlotWindows, slot_windows

WriteKV = Callable[[int, torch.Tensor], None]


class SlotMemory(Protocol):
    # True when the K/V buffers are all of it: a finished background restore may write them on the reader's
    # thread (engine.runtime.pending_restores); other kinds write through their own restore writer.
    direct_kv: bool

    def clear(self, slot: int) -> None:
        """Forget what the slot holds beyond its K/V rows (the runtime clears those)."""

    def reusable(self, slot: int, held: int, common: int) -> int:
        """Tokens of the slot's `held` a prompt sharing `common` of them can keep (<= common)."""

    def rewind(self, slot: int, to: int) -> None:
        """The slot keeps its first `to` tokens (`to` as `reusable` gave it, or 0)."""

    def rewind_inexact(self) -> str:
        """Why a slot cannot be rewound to any token it holds (a speculative draft's rejected rows dropped), or ""
        when it can: engine/runtime/speculation.py declines to speculate then."""

    def park_parts(self, slot: int, n_tokens: int, prompt_tokens: int) -> tuple[ReadParts, dict[int, Parts] | None]:
        """What the cache parks of the slot's `n_tokens`: the reader of its blocks, and its checkpoints."""

    def restore_writer(self, slot: int, write_kv: WriteKV) -> WriteParts:
        """The cache's writer of a restore into the slot, K/V pieces through `write_kv`."""

    def resumes_at(self, slot: int, restored: int) -> int:
        """Where the slot's next prefill starts after a restore of `restored` tokens (== restored when sound)."""

    def before_step(self, slot: int, start: int, end: int, prompt_len: int) -> None:
        """A forward over tokens [start, end) of the slot is about to run."""

    def after_step(self, slot: int, prompt_len: int) -> None:
        """That forward ran."""

    def forward_args(self) -> tuple[Any, ...]:
        """What the model's forward takes beside the K/V buffers."""

    def session_checkpoints(self, slot: int, n_tokens: int) -> dict[int, Parts] | None:
        """What a session file saves beside the K/V; BadValue when the slot cannot be saved whole."""

    def put_session(self, slot: int, n_tokens: int, checkpoints: dict[int, Parts] | None) -> None:
        """A session file's state, after its K/V rows were written."""

    def identity(self) -> dict[str, Any]:
        """What the cache's identity says of this memory (CacheIdentity's state, window and local_layers)."""


class AttentionMemory:
    """Full attention: the K/V rows are all a slot holds."""

    direct_kv = True

    def __init__(self, kv: KVBuffers) -> None:
        self.kv = kv

    def clear(self, slot: int) -> None:
        pass

    def reusable(self, slot: int, held: int, common: int) -> int:
        return common

    def rewind(self, slot: int, to: int) -> None:
        pass  # the rows past `to` are overwritten by the next ones computed

    def rewind_inexact(self) -> str:
        return ""

    def park_parts(self, slot: int, n_tokens: int, prompt_tokens: int) -> tuple[ReadParts, dict[int, Parts] | None]:
        return kv_reader(lambda a, b: self.kv.read(slot, a, b)), None

    def restore_writer(self, slot: int, write_kv: WriteKV) -> WriteParts:
        return kv_writer(write_kv)

    def resumes_at(self, slot: int, restored: int) -> int:
        return restored

    def before_step(self, slot: int, start: int, end: int, prompt_len: int) -> None:
        pass

    def after_step(self, slot: int, prompt_len: int) -> None:
        pass

    def forward_args(self) -> tuple[Any, ...]:
        return ()

    def session_checkpoints(self, slot: int, n_tokens: int) -> dict[int, Parts] | None:
        return None

    def put_session(self, slot: int, n_tokens: int, checkpoints: dict[int, Parts] | None) -> None:
        pass

    def identity(self) -> dict[str, Any]:
        return {"state": None, "window": None, "local_layers": ()}


class WindowMemory(AttentionMemory):
    """A sliding-window model: its local layers' rows are the slot's own only from its floor on."""

    direct_kv = False

    def __init__(self, kv: KVBuffers, windows: SlotWindows) -> None:
        super().__init__(kv)
        self.windows = windows

    def clear(self, slot: int) -> None:
        self.windows.clear(slot)

    def reusable(self, slot: int, held: int, common: int) -> int:
        return self.windows.reusable(slot, common)

    def rewind(self, slot: int, to: int) -> None:
        if to == 0:
            self.windows.clear(slot)

    def park_parts(self, slot: int, n_tokens: int, prompt_tokens: int) -> tuple[ReadParts, dict[int, Parts] | None]:
        # the global layers in blocks, the local layers' last window with the conversation
        return self.windows.reader(slot), self.windows.checkpoints(slot, n_tokens, prompt_tokens)

    def restore_writer(self, slot: int, write_kv: WriteKV) -> WriteParts:
        self.windows.clear(slot)
        return self.windows.writer(slot, write_kv)

    def session_checkpoints(self, slot: int, n_tokens: int) -> dict[int, Parts] | None:
        if self.windows.floors[slot]:
            raise BadValue(f"slot {slot} was restored from the conversation cache, which keeps only the last "
                           "window of the local layers' K/V; a session file needs all of it: send the next turn "
                           "first, or prefill the slot anew", param="id")
        return None

    def put_session(self, slot: int, n_tokens: int, checkpoints: dict[int, Parts] | None) -> None:
        self.windows.clear(slot)  # a session file holds every row of every layer

    def identity(self) -> dict[str, Any]:
        return {"state": None, "window": self.windows.window, "local_layers": tuple(self.windows.local.tolist())}


class RecurrentMemory(AttentionMemory):
    """A hybrid model: the recurrent state after exactly the slot's tokens, and checkpoints to resume from."""

    direct_kv = False

    def __init__(self, kv: KVBuffers, states: SlotStates) -> None:
        super().__init__(kv)
        self.states = states

    def clear(self, slot: int) -> None:
        self.states.clear(slot)

    def reusable(self, slot: int, held: int, common: int) -> int:
        return self.states.reusable(slot, held, common)

    def rewind(self, slot: int, to: int) -> None:
        self.states.rewind(slot, to)  # a verify's last accepted token: the state kept after its drafted row

    def park_parts(self, slot: int, n_tokens: int, prompt_tokens: int) -> tuple[ReadParts, dict[int, Parts] | None]:
        return kv_reader(lambda a, b: self.kv.read(slot, a, b)), self.states.park_checkpoints(slot, n_tokens)

    def restore_writer(self, slot: int, write_kv: WriteKV) -> WriteParts:
        return self.states.writer(slot, write_kv)

    def resumes_at(self, slot: int, restored: int) -> int:
        return self.states.position(slot)

    def before_step(self, slot: int, start: int, end: int, prompt_len: int) -> None:
        self.states.before_prefill(slot, start, end, prompt_len)  # a block end crossed in decode too

    def after_step(self, slot: int, prompt_len: int) -> None:
        self.states.after_prefill(slot, prompt_len)

    def forward_args(self) -> tuple[Any, ...]:
        return (self.states.buffers,)

    def session_checkpoints(self, slot: int, n_tokens: int) -> dict[int, Parts] | None:
        return self.states.park_checkpoints(slot, n_tokens)

    def put_session(self, slot: int, n_tokens: int, checkpoints: dict[int, Parts] | None) -> None:
        assert checkpoints and n_tokens in checkpoints, "a hybrid model's session file carries its state"
        self.states.put_parts(slot, n_tokens, checkpoints)

    def identity(self) -> dict[str, Any]:
        return {"state": self.states.buffers.layout.describe(), "window": None, "local_layers": ()}


def slot_memory(model: Any, config: Any, n_slots: int, ctx: int, kv_dtype: torch.dtype, stages: Any,
                every: int, block_tokens: int) -> tuple[KVBuffers, SlotMemory]:
    """The slots' K/V buffers and the memory beside them, for `model` (its config `config`): the one place that
    tells the kinds apart. A hybrid model makes its own buffers (K/V of its attention layers and the recurrent
    state); a model whose config declares sliding layers parks only their last window."""
    from engine.model.hybrid import HybridCausalLM

    if isinstance(model, HybridCausalLM):
        kv, states = hybrid_buffers(model, n_slots, ctx, every, kv_dtype)
        return kv, RecurrentMemory(kv, states)
    heads, width = config.kv_row  # one row shape for every layer (Gemma 4's differ: the widest holds them)
    # Gemma 4's K/V-sharing layers (the last ones) hold no K/V: the slots and the cache keep the layers before them.
    n_kv = config.kv_layers
    kv_stages = [(d, a, min(b, n_kv)) for d, a, b in stages if a < n_kv]
    kv = KVBuffers(KVLayout(n_kv, heads, width, kv_dtype), n_slots, ctx, kv_stages)
    windows = slot_windows(config, kv, block_tokens)
    return kv, (AttentionMemory(kv) if windows is None else WindowMemory(kv, windows))
