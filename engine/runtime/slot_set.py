"""The slot set: the slots over the preallocated K/V, and what each holds beside it (engine/runtime/memory.py).

Every change to what a slot holds goes through here or through the slot's own fields, on the engine thread; the
K/V rows and the memory's parts are cleared together, so a slot never holds K/V of one conversation and the
recurrent state or windows of another.
"""

from __future__ import annotations

import torch

from engine.cache.attrs import DEFAULT_PRIORITY, NO_ATTRS
from engine.errors import Busy, NotFound
from engine.kv import KVBuffers
from engine.runtime.memory import SlotMemory
from engine.runtime.state import Slot


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    ta = torch.tensor(a[:n], dtype=torch.int64)
    tb = torch.tensor(b[:n], dtype=torch.int64)
    diff = (ta != tb).nonzero()
    return int(diff[0].item()) if diff.numel() else n


class SlotSet:
    """`n_slots` slots of `ctx_size` tokens each (engine thread only)."""

    def __init__(self, kv: KVBuffers, memory: SlotMemory, ctx_size: int) -> None:
        self.kv = kv
        self.memory = memory
        self.ctx_size = ctx_size
        self.slots = [Slot(i) for i in range(kv.n_slots)]

    def __len__(self) -> int:
        return len(self.slots)

    def free(self) -> list[Slot]:
        """Slots a request can take: serving nothing and waiting for no restore."""
        return [s for s in self.slots if s.active is None and not s.restoring]

    def busy(self) -> int:
        return sum(1 for s in self.slots if s.active is not None or s.restoring)

    def any_active(self) -> bool:
        return any(s.active is not None for s in self.slots)

    def info(self) -> list[dict]:
        """GET /slots: each slot's state and fill."""
        return [
            {
                "id": s.id,
                "state": "busy" if s.active or s.restoring else "idle",
                "n_tokens": len(s.tokens),
                "n_ctx": self.ctx_size,
                "last_used": s.last_used or None,
            }
            for s in self.slots
        ]

    def forget(self, slot: Slot) -> None:
        """The slot holds nothing any more: its tokens, K/V rows and memory parts go together."""
        slot.tokens = []
        self.kv.clear(slot.id)
        self.memory.clear(slot.id)

    def live_reuse(self, slot: Slot, prompt: list[int], usable: int) -> int:
        """Tokens of the slot's contents this prompt can keep (a hybrid model: up to a state checkpoint)."""
        common = min(common_prefix(slot.tokens, prompt), usable)
        return self.memory.reusable(slot.id, len(slot.tokens), common)

    def keep(self, slot: Slot, n: int) -> None:
        """The slot goes on from its first `n` tokens (a request reusing them); the rest is dropped."""
        slot.tokens = slot.tokens[:n]
        self.memory.rewind(slot.id, n)

    def idle(self, slot_id: int) -> Slot:
        """The slot a slot-file operation names, which must exist and be idle."""
        if not 0 <= slot_id < len(self.slots):
            raise NotFound(f"slot {slot_id} does not exist; slots are 0..{len(self.slots) - 1}", param="id")
        slot = self.slots[slot_id]
        if slot.active is not None or slot.restoring:
            raise Busy(f"slot {slot_id} is busy with a request; try again when it is idle", param="id")
        return slot

    def write_session(self, slot: Slot, tokens: list[int], kv: torch.Tensor, states: dict | None = None) -> None:
        """The slot holds `tokens` from a session file: their K/V and, for a hybrid model, its state after them."""
        slot.tokens, slot.conversation_id, slot.unnamed = [], None, []  # a session file is no parked conversation
        self._no_request(slot)
        try:
            self.kv.write(slot.id, 0, kv)
            self.memory.put_session(slot.id, len(tokens), states)
        except BaseException:
            self.forget(slot)
            raise
        slot.tokens, slot.prompt = list(tokens), list(tokens)  # all of it context, as a prompt is

    def erase(self, slot: Slot) -> int:
        """Empty an idle slot; the number of tokens it held."""
        n = len(slot.tokens)
        slot.conversation_id, slot.unnamed = None, []
        self._no_request(slot)
        self.forget(slot)
        return n

    @staticmethod
    def _no_request(slot: Slot) -> None:
        """What the slot's last request said of its conversation (name, client, priority, pin, prompt) no longer
        describes what it holds: a park of the slot's new contents must not carry it."""
        slot.attrs, slot.priority, slot.pinned, slot.prompt = NO_ATTRS, DEFAULT_PRIORITY, False, []
