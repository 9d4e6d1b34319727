"""Per-slot recurrent state of a hybrid model's recurrent layers, beside the K/V buffers of its attention layers.

A recurrent layer keeps a fixed-size state per sequence whatever its length: the last `conv_kernel - 1`
inputs of its short convolution ("conv" part) and, for gated DeltaNet and Mamba-2, the SSM / delta-rule
matrix ("ssm" part). Each part is one preallocated tensor per layer, [n_slots, *shape], on the device of the
stage that owns the layer, like KVBuffers' per-stage K/V.

Unlike K/V, a state cannot be cut at an arbitrary prefix: it is the state *after* exactly `position[slot]`
tokens. The buffers record that position; the forward pass asserts a chunk starts there (or at 0, which
starts from a zero state), so restoring K/V without the matching state fails loudly instead of silently
computing garbage.

The cache sees state only through `read` / `write` / `clear` with `StateSnapshot`s: one CPU tensor per
(recurrent layer, part) in `StateLayout.parts()` order, independent of the layer split, so a state parked
under one split restores under another. The forward pass can also return snapshots at token positions inside
a prefill chunk (checkpoints) without a second pass: `request_checkpoints` before the call,
`take_checkpoints` after it (the mixers cut their scan at those positions and copy the state there).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from engine.model.hybrid.config import DELTA, MAMBA_KINDS, RECURRENT_KINDS, SHORT_CONV, HybridConfig


@dataclass(frozen=True, slots=True)
class StatePart:
    """One tensor of one layer's state: `shape` per slot (token-major conv rows, then the SSM matrix)."""

    layer: int
    name: str  # "conv" | "ssm"
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StateLayout:
    """The shapes of one slot's recurrent state across all recurrent layers; part of a parked state's identity."""

    parts: tuple[StatePart, ...]
    dtype: torch.dtype

    @classmethod
    def for_config(cls, config: HybridConfig, dtype: torch.dtype) -> StateLayout:
        c = config
        conv_rows = c.conv_kernel - 1
        parts: list[StatePart] = []
        for li, kind in enumerate(c.layer_kinds):
            if kind not in RECURRENT_KINDS:  # attention (K/V instead) or a feed-forward-only block
                continue
            parts.append(StatePart(li, "conv", (conv_rows, c.conv_channels)))
            if kind == DELTA:  # S[h] maps a key (k_dim) to a value (v_dim)
                parts.append(StatePart(li, "ssm", (c.linear_v_heads, c.linear_k_dim, c.linear_v_dim)))
            elif kind in MAMBA_KINDS:
                parts.append(StatePart(li, "ssm", (c.mamba_heads, c.mamba_head_dim, c.mamba_state_dim)))
            else:
                assert kind == SHORT_CONV, kind
        return cls(tuple(parts), dtype)

    @property
    def bytes_per_slot(self) -> int:
        return sum(_numel(p.shape) for p in self.parts) * self.dtype.itemsize

    def describe(self) -> dict:
        return {
            "parts": [[p.layer, p.name, list(p.shape)] for p in self.parts],
            "dtype": str(self.dtype).removeprefix("torch."),
        }


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@dataclass(slots=True)
class StateSnapshot:
    """One slot's recurrent state after `position` tokens, as CPU tensors in `StateLayout.parts` order."""

    position: int
    tensors: tuple[torch.Tensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


class RecurrentStateBuffers:
    """Recurrent state for `n_slots` slots, each layer's parts on the device of the stage that owns the layer."""

    def __init__(self, layout: StateLayout, n_slots: int, stages: Sequence[tuple[torch.device | str, int, int]]) -> None:
        assert stages and stages[0][1] == 0, "stages must start at layer 0"
        for (_, _, end), (_, first, _) in zip(stages, stages[1:], strict=False):
            assert end == first, "stages must be contiguous"
        self.layout = layout
        self.n_slots = n_slots
        device_of = {li: torch.device(d) for d, a, b in stages for li in range(a, b)}
        self._parts: dict[tuple[int, str], torch.Tensor] = {}
        for p in layout.parts:
            assert p.layer in device_of, f"layer {p.layer} is on no stage"
            self._parts[(p.layer, p.name)] = torch.zeros((n_slots, *p.shape), dtype=layout.dtype, device=device_of[p.layer])
        self.positions = [0] * n_slots  # tokens absorbed by each slot's state
        self._wanted: dict[int, list[int]] = {}
        self._captured: dict[int, dict[int, list[torch.Tensor | None]]] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._parts.values())

    def part(self, layer: int, name: str) -> torch.Tensor:
        """The [n_slots, *shape] tensor of one part of one layer, on that layer's device."""
        return self._parts[(layer, name)]

    # ------------------------------------------------------------ what the cache uses

    def read(self, slot: int) -> StateSnapshot:
        """Copy `slot`'s state to CPU tensors (the layout the cache parks)."""
        assert 0 <= slot < self.n_slots, slot
        tensors = tuple(self._parts[(p.layer, p.name)][slot].to("cpu", copy=True) for p in self.layout.parts)
        return StateSnapshot(self.positions[slot], tensors)

    def write(self, slot: int, snapshot: StateSnapshot) -> None:
        """Restore `slot`'s state from a snapshot taken by `read` or `take_checkpoints`."""
        assert 0 <= slot < self.n_slots, slot
        assert len(snapshot.tensors) == len(self.layout.parts), (len(snapshot.tensors), len(self.layout.parts))
        for p, t in zip(self.layout.parts, snapshot.tensors, strict=True):
            assert tuple(t.shape) == p.shape and t.dtype == self.layout.dtype, (p, tuple(t.shape), t.dtype)
        for p, t in zip(self.layout.parts, snapshot.tensors, strict=True):
            self._parts[(p.layer, p.name)][slot].copy_(t)
        self.positions[slot] = snapshot.position

    def clear(self, slot: int) -> None:
        """Zero a slot (a fresh sequence; also after a failed restore)."""
        for t in self._parts.values():
            t[slot].zero_()
        self.positions[slot] = 0
        self._wanted.pop(slot, None)
        self._captured.pop(slot, None)

    # ------------------------------------------------------------ checkpoints inside a prefill chunk

    def request_checkpoints(self, slot: int, positions: Iterable[int]) -> None:
        """Ask the next forward pass over `slot` for snapshots after these absolute token positions.

        A position must fall inside the chunk that call runs for the slot, (start, start + n]; the end of
        the chunk is allowed (then it equals `read` after the call)."""
        self._wanted[slot] = sorted(set(int(p) for p in positions))

    def wants(self, slot: int, position: int) -> bool:
        """A snapshot after `position` tokens was requested for `slot` (a row of a speculative verify)."""
        return position in self._wanted.get(slot, ())

    def wanted(self, slot: int, start: int, end: int) -> list[int]:
        """Checkpoint positions requested for `slot` strictly inside (start, end) (the end is the final state)."""
        wanted = self._wanted.get(slot, [])
        outside = [p for p in wanted if not start < p <= end]
        assert not outside, f"slot {slot}: checkpoint positions {outside} are outside the chunk ({start}, {end}]"
        return [p for p in wanted if p < end]

    def capture(self, slot: int, position: int, layer: int, name: str, value: torch.Tensor) -> None:
        """Called by a mixer: `value` is part (`layer`, `name`) of `slot`'s state after `position` tokens."""
        index = next(i for i, p in enumerate(self.layout.parts) if p.layer == layer and p.name == name)
        row = self._captured.setdefault(slot, {}).setdefault(position, [None] * len(self.layout.parts))
        row[index] = value.to("cpu", dtype=self.layout.dtype, copy=True)

    def finish_chunk(self, slot: int, end: int) -> None:
        """Called by the forward pass after every layer ran a chunk of `slot` that ended at `end`."""
        self.positions[slot] = end
        wanted = self._wanted.pop(slot, None)
        if wanted and wanted[-1] == end:
            self._captured.setdefault(slot, {})[end] = list(self.read(slot).tensors)

    def take_checkpoints(self, slot: int) -> dict[int, StateSnapshot]:
        """The snapshots captured for `slot` since the last call, by position."""
        out = {}
        for pos, tensors in sorted(self._captured.pop(slot, {}).items()):
            assert all(t is not None for t in tensors), f"slot {slot}: checkpoint at {pos} misses a layer's state"
            out[pos] = StateSnapshot(pos, tuple(tensors))  # type: ignore[arg-type]
        return out
