"""The recurrent state of a hybrid model's slots, beside the K/V buffers: the running state and its checkpoints.

A recurrent layer's state is valid only after exactly the tokens it absorbed: it cannot be cut back to a prefix
the way K/V rows can. So each slot keeps host copies of its state at chosen positions (checkpoints), taken by
the prefill itself (`RecurrentStateBuffers.request_checkpoints`, no second pass):
- every `every` tokens (absolute multiples, `--conversation-cache-checkpoint-tokens` rounded up to a multiple of
  the cache's block size, so each falls on a block boundary), in decode too (a generated answer that is sent
  back re-rendered into other tokens resumes from the last block end before the change, so the rows of a block the
  cache already holds are never computed a second way: decoded and prefilled rows differ in their last bits), and
- at the end of every prompt (the state before its last token, which is computed alone: a request that asks the
  same prompt again, or a restart that finds the whole prompt parked, resumes exactly there).
A slot reuses its own contents up to the deepest checkpoint within the common prefix (or all of them when the
new prompt extends them); the cache parks the checkpoints with the conversation's K/V.

Checkpoints are absolute positions the same on every engine, so the chunked scans cut their blocks at the same
places whichever way a conversation reached them (parked or not): byte-identical states.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.cache.parts import Parts, WriteParts

if TYPE_CHECKING:
    from engine.model.hybrid import RecurrentStateBuffers, StateSnapshot

# Prompt-end checkpoints a slot keeps beyond the periodic ones (the newest win): enough for a regenerated
# answer and an edited last message, bounded whatever the number of turns.
PROMPT_END_CHECKPOINTS = 2


def checkpoint_interval(tokens: int, block_tokens: int) -> int:
    """`--conversation-cache-checkpoint-tokens` rounded up to a multiple of the block size (0 stays 0)."""
    assert tokens >= 0 and block_tokens > 0, (tokens, block_tokens)
    return -(-tokens // block_tokens) * block_tokens


class SlotStates:
    """Every slot's running recurrent state (the model's buffers) and its checkpoints (host snapshots)."""

    def __init__(self, buffers: RecurrentStateBuffers, every: int) -> None:
        assert every >= 0, every
        self.buffers = buffers
        self.every = every
        self.checkpoints: list[dict[int, StateSnapshot]] = [{} for _ in range(buffers.n_slots)]
        self._prompt_ends: list[list[int]] = [[] for _ in range(buffers.n_slots)]
        self._part_names: list[str] | None = None
        # The last step's drafted positions (a speculative verify) and the state after each: what a rewind to
        # the last accepted token writes back; dropped by that rewind or the next step.
        self._drafted: list[list[int]] = [[] for _ in range(buffers.n_slots)]
        self._drafts: list[dict[int, StateSnapshot]] = [{} for _ in range(buffers.n_slots)]

    @property
    def nbytes(self) -> int:
        return self.buffers.nbytes

    def position(self, slot: int) -> int:
        return self.buffers.positions[slot]

    # ------------------------------------------------------------ reuse of a slot's own contents

    def reusable(self, slot: int, held: int, common: int) -> int:
        """Tokens of the slot's `held` tokens a prompt sharing `common` of them can keep: all when it extends
        them, else the deepest checkpoint within the common prefix (0 when none)."""
        if common >= held:
            assert self.buffers.positions[slot] == held, (slot, self.buffers.positions[slot], held)
            return held
        return max((p for p in self.checkpoints[slot] if p <= common), default=0)

    def rewind(self, slot: int, to: int) -> None:
        """Put the slot's state back to position `to` (a checkpoint, a drafted position of the last step, or 0);
        later checkpoints are dropped, and the last step's drafted positions in any case."""
        drafts, self._drafts[slot] = self._drafts[slot], {}
        if to == self.buffers.positions[slot]:
            self._forget_after(slot, to)
            return
        if to == 0:
            self.clear(slot)
            return
        self.buffers.write(slot, drafts[to] if to in drafts else self.checkpoints[slot][to])
        self._forget_after(slot, to)

    def _forget_after(self, slot: int, to: int) -> None:
        self.checkpoints[slot] = {p: s for p, s in self.checkpoints[slot].items() if p <= to}
        self._prompt_ends[slot] = [p for p in self._prompt_ends[slot] if p <= to]

    def clear(self, slot: int) -> None:
        self.buffers.clear(slot)
        self.checkpoints[slot] = {}
        self._prompt_ends[slot] = []
        self._drafts[slot], self._drafted[slot] = {}, []

    def put(self, slot: int, snapshot: StateSnapshot, checkpoints: dict[int, StateSnapshot]) -> None:
        """A restored state (at `snapshot.position`) and the checkpoints that came with it."""
        self.buffers.write(slot, snapshot)
        self.checkpoints[slot] = {p: s for p, s in checkpoints.items() if p <= snapshot.position}
        self.checkpoints[slot][snapshot.position] = snapshot
        self._prompt_ends[slot] = []

    # ------------------------------------------------------------ checkpoints taken by the prefill

    def before_prefill(self, slot: int, start: int, end: int, prompt_len: int) -> None:
        """Ask the forward over tokens [start, end) of `slot` for its checkpoints in (start, end]. In decode
        (`start` past the prompt) every row but the last is a draft token's: the state after each is kept until
        the verify's outcome is known, so the slot can be rewound to the last accepted one."""
        wanted = []
        if self.every:
            wanted = list(range((start // self.every + 1) * self.every, end + 1, self.every))
        if start < prompt_len - 1 <= end:
            wanted.append(prompt_len - 1)
        self._drafts[slot] = {}
        self._drafted[slot] = list(range(start + 1, end)) if start >= prompt_len else []
        if wanted or self._drafted[slot]:
            self.buffers.request_checkpoints(slot, wanted + self._drafted[slot])

    def after_prefill(self, slot: int, prompt_len: int) -> None:
        taken = self.buffers.take_checkpoints(slot)
        drafted = self._drafted[slot]
        self._drafts[slot] = {p: taken[p] for p in drafted}
        # a drafted position on a block end stays a checkpoint too (dropped by the rewind if it was rejected)
        taken = {p: snap for p, snap in taken.items() if p not in drafted or (self.every and p % self.every == 0)}
        if not taken:
            return
        self.checkpoints[slot].update(taken)
        end = prompt_len - 1
        if end in taken and not (self.every and end % self.every == 0):
            ends = [p for p in self._prompt_ends[slot] if p != end] + [end]
            for old in ends[:-PROMPT_END_CHECKPOINTS]:
                if not (self.every and old % self.every == 0):
                    self.checkpoints[slot].pop(old, None)
            self._prompt_ends[slot] = ends[-PROMPT_END_CHECKPOINTS:]

    def read(self, slot: int) -> StateSnapshot:
        return self.buffers.read(slot)

    # ------------------------------------------------------------ what the cache parks and restores

    def park_checkpoints(self, slot: int, n_tokens: int) -> dict[int, Parts]:
        """The slot's checkpoints within its `n_tokens` tokens and its running state (at `n_tokens`), as the
        cache's state parts."""
        out = {p: self._parts(s) for p, s in self.checkpoints[slot].items() if p <= n_tokens}
        if self.buffers.positions[slot] == n_tokens:
            out[n_tokens] = self._parts(self.buffers.read(slot))
        return out

    def writer(self, slot: int, write_kv: Callable[[int, torch.Tensor], None]) -> WriteParts:
        """The cache's restore writer for `slot`: K/V pieces through `write_kv`, the recurrent state (the last
        call, at the restored position) into the state buffers."""
        def write(start: int, parts: Parts) -> None:
            if "kv" in parts:
                write_kv(start, parts["kv"])
            else:
                self.put(slot, self._snapshot(start, parts), {})
        return write

    def put_parts(self, slot: int, position: int, checkpoints: dict[int, Parts]) -> None:
        """A saved slot's state (the checkpoint at `position`, its last token) and its other checkpoints."""
        snaps = {p: self._snapshot(p, parts) for p, parts in checkpoints.items()}
        self.put(slot, snaps[position], snaps)

    def _snapshot(self, position: int, parts: Parts) -> StateSnapshot:
        from engine.model.hybrid import StateSnapshot

        return StateSnapshot(position, tuple(parts[n] for n in self._names()))

    def _names(self) -> list[str]:
        if self._part_names is None:
            from engine.cache.parts import state_specs

            self._part_names = [spec.name for spec in state_specs(self.buffers.layout.describe())]
        return self._part_names

    def _parts(self, snapshot: StateSnapshot) -> Parts:
        return dict(zip(self._names(), snapshot.tensors, strict=True))



def hybrid_buffers(model, n_slots: int, ctx: int, every: int, kv_dtype: torch.dtype | None = None):
    """(K/V buffers of the attention layers in `kv_dtype`, SlotStates of the recurrent ones) of a HybridCausalLM."""
    kv, state = model.new_buffers(n_slots, ctx, kv_dtype)
    return kv, SlotStates(state, every)
