"""State parts: what one parked block (or a conversation's tail) holds, by name and kind.

A block's state is one or more parts, each a host tensor with a token axis. Today a model has one part, the
attention K/V of every layer (`kv`, kind `attn_kv`, [n_layers, 2, tokens, kv_heads, head_dim], whatever the
layer split). Files store each part as a tensor under its name, budgets count the bytes of every part,
restores validate and copy every part, so another kind of state (a recurrent-state checkpoint of a hybrid
model) is a new `PartSpec`, not a second store.
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


@dataclass(frozen=True, slots=True)
class PartSpec:
    name: str  # the tensor's name in files
    kind: str
    dtype: torch.dtype
    dims: tuple[int, ...]  # the shape, with -1 at the token axis
    token_axis: int

    def shape(self, n_tokens: int) -> tuple[int, ...]:
        return tuple(n_tokens if i == self.token_axis else d for i, d in enumerate(self.dims))

    def nbytes(self, n_tokens: int) -> int:
        n = self.dtype.itemsize
        for d in self.shape(n_tokens):
            n *= d
        return n


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
