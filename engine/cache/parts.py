"""State parts: what one parked block (or a conversation's tail) holds, by name and kind.

A block's state is one or more parts, each a host tensor with a token axis. Today a model has one part, the
attention K/V of every layer (`kv`, kind `attn_kv`, [n_layers, 2, tokens, kv_heads, head_dim], whatever the
layer split). Files store each part as a tensor under its name, budgets count the bytes of every part,
restores validate and copy every part, so another kind of state (a recurrent-state checkpoint of a hybrid
model) is a new `PartSpec`, not a second store.

A hybrid model adds *state parts* (kinds `recurrent_conv`, `recurrent_ssm`: one per recurrent layer and part,
named `state.<layer>.<conv|ssm>`), which have no token axis: a state is valid only after exactly the tokens it
absorbed, so it is parked as *checkpoints* (the whole state at a token position). A checkpoint at a block's end
is stored in that block, beside its K/V (shared like the block, by its chained key); any other checkpoint (a
prompt's end, the conversation's end inside its last partial block) with the conversation itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from engine.kv import KVLayout

Parts = dict[str, torch.Tensor]
ReadParts = Callable[[int, int], Parts]
"""`read_parts(start, end)`: every part of tokens [start, end) of the slot being parked, in host memory."""

ATTN_KV = "attn_kv"
NO_TOKEN_AXIS = -1  # a state part: one value per checkpoint, not per token


@dataclass(frozen=True, slots=True)
class PartSpec:
    name: str  # the tensor's name in files
    kind: str
    dtype: torch.dtype
    dims: tuple[int, ...]  # the shape, with -1 at the token axis
    token_axis: int

    @property
    def per_token(self) -> bool:
        return self.token_axis != NO_TOKEN_AXIS

    def shape(self, n_tokens: int) -> tuple[int, ...]:
        return tuple(n_tokens if i == self.token_axis else d for i, d in enumerate(self.dims))

    def nbytes(self, n_tokens: int) -> int:
        n = self.dtype.itemsize
        for d in self.shape(n_tokens):
            n *= d
        return n

    def fits(self, shape: tuple[int, ...]) -> bool:
        """A tensor of `shape` is this part: every dimension but the token axis (any length) as the spec says."""
        shape = tuple(shape)
        if len(shape) != len(self.dims):
            return False
        return shape == (self.dims if not self.per_token else self.shape(shape[self.token_axis]))


def layout_parts(layout: KVLayout) -> tuple[PartSpec, ...]:
    """The parts of a model with this K/V layout: attention K/V only (every layer, stage-independent)."""
    dims = layout.host_shape(-1)
    return (PartSpec("kv", ATTN_KV, layout.dtype, dims, dims.index(-1)),)


def parts_nbytes(parts: Mapping[str, torch.Tensor] | None) -> int:
    return sum(t.nbytes for t in parts.values()) if parts else 0


def n_tokens_of(specs: tuple[PartSpec, ...], parts: Mapping[str, torch.Tensor]) -> int:
    spec = specs[0]
    return parts[spec.name].shape[spec.token_axis]


def check_parts(specs: tuple[PartSpec, ...], parts: Mapping[str, torch.Tensor], n: int) -> Parts:
    """Every part of `n` tokens, as contiguous host tensors; ValueError naming the first part that is wrong."""
    if set(parts) != {s.name for s in specs}:
        raise ValueError(f"state parts {sorted(parts)}, expected {sorted(s.name for s in specs)}")
    out: Parts = {}
    for spec in specs:
        t = parts[spec.name]
        if tuple(t.shape) != spec.shape(n) or t.dtype != spec.dtype:
            raise ValueError(f"part {spec.name} is {tuple(t.shape)} {t.dtype}, expected {spec.shape(n)} {spec.dtype}")
        out[spec.name] = (t if t.device.type == "cpu" else t.cpu()).contiguous()
    return out


WriteParts = Callable[[int, Parts], None]
"""`write_parts(start, parts)`: put every restored part into the slot from token `start` on."""


def kv_reader(read_kv: Callable[[int, int], torch.Tensor]) -> ReadParts:
    """The parts reader of a model whose only state is attention K/V, from its K/V reader."""
    return lambda start, end: {"kv": read_kv(start, end)}


def kv_writer(write_kv: Callable[[int, torch.Tensor], None]) -> WriteParts:
    """The parts writer of a model whose only state is attention K/V, from its K/V writer."""
    return lambda start, parts: write_kv(start, parts["kv"])


def describe_parts(specs: tuple[PartSpec, ...]) -> list[dict]:
    return [
        {"name": s.name, "kind": s.kind, "dtype": str(s.dtype).removeprefix("torch."), "dims": list(s.dims)}
        for s in specs
    ]


def first_tokens(specs: tuple[PartSpec, ...], parts: Parts, n: int) -> Parts:
    """The first `n` tokens of every part (views, no copy)."""
    return {s.name: parts[s.name].narrow(s.token_axis, 0, n) for s in specs}


def state_specs(state: dict) -> tuple[PartSpec, ...]:
    """The state parts of a hybrid model from its state layout's description (`StateLayout.describe()`:
    {"parts": [[layer, "conv" | "ssm", shape], ...], "dtype": ...}), in that order."""
    dtype = getattr(torch, state["dtype"])
    return tuple(
        PartSpec(f"state.{layer}.{name}", f"recurrent_{name}", dtype, tuple(shape), NO_TOKEN_AXIS)
        for layer, name, shape in state["parts"]
    )


def check_state(specs: tuple[PartSpec, ...], parts: Mapping[str, torch.Tensor]) -> Parts:
    """Every state part of one checkpoint as contiguous host tensors; ValueError naming what is wrong."""
    if set(parts) != {s.name for s in specs}:
        raise ValueError(f"checkpoint parts {sorted(parts)[:4]}..., expected {sorted(s.name for s in specs)[:4]}...")
    out: Parts = {}
    for spec in specs:
        t = parts[spec.name]
        if not spec.fits(tuple(t.shape)) or t.dtype != spec.dtype:
            raise ValueError(f"part {spec.name} is {tuple(t.shape)} {t.dtype}, expected {spec.dims} {spec.dtype}")
        out[spec.name] = (t if t.device.type == "cpu" else t.cpu()).contiguous()
    return out


def only(specs: tuple[PartSpec, ...], parts: Mapping[str, torch.Tensor]) -> Parts:
    """The parts of `parts` that `specs` name (a block's K/V without the checkpoint stored beside it)."""
    return {s.name: parts[s.name] for s in specs}


@dataclass(slots=True)
class Checkpoints:
    """A park's checkpoints, placed: `blocks` maps a block index to the state at that block's end, `own` a
    position to a state the conversation keeps itself (not at a block end)."""

    blocks: dict[int, Parts]
    own: dict[int, Parts]

    @classmethod
    def place(cls, states: Mapping[int, Parts], n_tokens: int, n_blocks: int, block_tokens: int,
              *, in_blocks: bool = True) -> Checkpoints:
        """`in_blocks` False: every checkpoint stays the conversation's own (a window of the local layers' K/V
        belongs to one conversation's end, not to a block other conversations share)."""
        blocks, own = {}, {}
        for pos, parts in states.items():
            if not 0 < pos <= n_tokens:
                continue
            if in_blocks and pos % block_tokens == 0 and pos // block_tokens <= n_blocks:
                blocks[pos // block_tokens - 1] = parts
            else:
                own[pos] = parts
        return cls(blocks, own)

    def settled(self, have: int, held_has_state: Callable[[int], bool], block_tokens: int) -> Checkpoints:
        """Placed for a park that reuses its first `have` blocks: a checkpoint for a held block that does
        not store one is kept by the conversation instead (a held block is never rewritten)."""
        moved = {i: p for i, p in self.blocks.items() if i < have and not held_has_state(i)}
        if not moved:
            return self
        own = {**self.own, **{(i + 1) * block_tokens: p for i, p in moved.items()}}
        return Checkpoints({i: p for i, p in self.blocks.items() if i not in moved}, own)

    @property
    def own_bytes(self) -> int:
        """Bytes of the checkpoints the conversation keeps itself."""
        return sum(parts_nbytes(p) for p in self.own.values())

    def new_blocks(self, have: int) -> int:
        """Checkpoints that go into blocks this park writes (index >= have; held blocks keep what they hold)."""
        return sum(1 for i in self.blocks if i >= have)


NO_CHECKPOINTS = Checkpoints({}, {})
