"""A large batch's routed experts run on the layer's GPU while the experts live in host RAM (llama.cpp's op offload).

With `--moe-experts cpu` beside a GPU, a decode step routes a few rows to each layer's experts and the CPU
multiplies the file's blocks where they lie. A prefill chunk routes hundreds of rows to nearly every expert, and
the CPU then multiplies all of a layer's experts for it: an 8K-token prompt took 36.5 s on an H200 host where
llama.cpp took 1.5 s (docs/BENCHMARKS.md). llama.cpp copies a layer's expert weights to the GPU when a batch has 32
rows or more and multiplies them there; so does this module. The blocks the used experts hold (as the file holds
them: Q4_K, Q6_K, Q8_0) go to the GPU, are decoded there by gguf_dequant's torch decoders (gguf-py's values, bit
for bit) into the layer's dtype a group of experts at a time (so the float copy stays small next to the
weights: `_GROUP_BYTES`), and each expert's rows run as GEMMs there, summed in ascending expert order as
moe.grouped_experts sums them.

Only in `fast` mode (a GPU without --deterministic): whether a step's experts run here or on the CPU depends on
how many rows the step holds, so a row's last bits then depend on what else the step holds, which fast mode
already allows on a GPU (engine/model/moe.py). A lone token, a decode step and --deterministic stay on the CPU.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from gguf import GGMLQuantizationType

from engine.model import gguf_dequant
from engine.model.kernels import RowsWeight
from engine.model.kquant_weight import KQuantWeight
from engine.model.q8_weight import Q8Weight

# llama.cpp's GGML_OP_OFFLOAD_MIN_BATCH: below this many rows a step's experts stay where they are (a decode step
# reads a few experts' rows once; copying a whole layer would cost more than it saves).
OFFLOAD_MIN_ROWS = 32
# Prompt tokens a prefill step takes, at the default --prefill-chunk, on a model that brings experts to its GPU: a
# chunk's cost is mostly the experts' trip over the bus, nearly the same for 512 rows as for 2048 (H100, a
# Qwen3-30B-A3B-shaped file: 0.21 s and 0.24 s a chunk), so a longer chunk prefills ~3.5x as fast while a decode
# stream beside it waits about as long per step.
PREFILL_CHUNK = 2048
# Decoded float weights kept on the GPU at once (one group of experts): a Qwen3-30B-A3B layer's experts are ~1.2 GB
# in bfloat16, more than a small card spares beside its layers and K/V.
_GROUP_BYTES = 128 << 20


def file_type(weights: object) -> GGMLQuantizationType | None:
    """The GGUF block type an expert stack is held in (one weight per expert, the file's Q4_K / Q6_K / Q8_0 rows),
    or None when its experts cannot be decoded on a GPU (float stacks, 4-bit groups)."""
    if not isinstance(weights, list) or not weights:
        return None
    first = weights[0]
    if isinstance(first, KQuantWeight):
        return GGMLQuantizationType[first.kind]
    if isinstance(first, Q8Weight):
        return GGMLQuantizationType.Q8_0
    return None


def offloadable(gate_up: object, down: object) -> bool:
    """Whether a layer's experts can run on its GPU: both stacks held as file blocks on the CPU."""
    types = (file_type(gate_up), file_type(down))
    if None in types:
        return False
    assert isinstance(gate_up, list) and isinstance(down, list)  # file_type: lists of RowsWeight
    return gate_up[0].device.type == "cpu" and down[0].device.type == "cpu"


class DeviceExperts:
    """One layer's expert stacks brought to `device` for one step: each expert's blocks copied once, decoded to
    `dtype` a group of experts at a time as `mlp(x, e)` asks for them in ascending order."""

    def __init__(self, gate_up: Sequence[Any], down: Sequence[Any], device: torch.device,
                 dtype: torch.dtype, *, group_bytes: int = _GROUP_BYTES) -> None:
        gate_type, down_type = file_type(gate_up), file_type(down)
        assert gate_type is not None and down_type is not None, "offloadable() is checked first"
        self.stacks = ((gate_up, gate_type), (down, down_type))
        self.device, self.dtype = device, dtype
        e = len(gate_up)
        n, k = gate_up[0].shape
        per_expert = (n * k + down[0].shape[0] * down[0].shape[1]) * dtype.itemsize
        self.group = max(1, min(e, group_bytes // per_expert))
        self.decoded: tuple[int, list[torch.Tensor], list[torch.Tensor]] | None = None

    def weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's [gate; up] and down matrices on the device, in `dtype`."""
        first = e - e % self.group
        if self.decoded is None or self.decoded[0] != first:
            self.decoded = None  # the previous group's floats go before the next group's are made
            last = min(first + self.group, len(self.stacks[0][0]))
            gate_up, down = (self._decode(stack, qtype, first, last) for stack, qtype in self.stacks)
            self.decoded = (first, gate_up, down)
        _, gate_up, down = self.decoded
        return gate_up[e - first], down[e - first]

    def _decode(self, stack: Sequence[RowsWeight], qtype: GGMLQuantizationType, first: int,
                last: int) -> list[torch.Tensor]:
        # One host-to-device copy and one decode for the group (a decode is ~20 elementwise launches whatever
        # its size): the experts' rows are consecutive in the group's blocks.
        blocks = _host_rows(stack[first:last]).to(self.device, non_blocking=True)
        rows = stack[first].shape[0]
        values = gguf_dequant.decode_rows(blocks, qtype, self.dtype)
        return list(values.split(rows))


def _host_rows(stack: Sequence[RowsWeight]) -> torch.Tensor:
    """The blocks of consecutive experts as one [experts * rows, bytes] tensor: a view where they lie one after
    another in memory (kquant_weight.expert_rows slices one fused stack), else a copy."""
    first = stack[0].blocks
    size = first.nbytes
    adjacent = all(w.blocks.is_contiguous() and w.blocks.data_ptr() == first.data_ptr() + j * size
                   for j, w in enumerate(stack))
    if not adjacent:
        return torch.cat([w.blocks for w in stack])
    rows, width = first.shape
    return first.as_strided((len(stack) * rows, width), (width, 1))


def pin_host_experts(layers: Iterable[Any]) -> int:
    """Page-lock (cudaHostRegister, in place) the host memory of every offloadable layer's expert blocks, so that
    their copies to the GPU run at the bus's speed, asynchronously, instead of through the driver's pageable
    staging (measured on an H100 host, a Qwen3-30B-A3B-shaped layer's experts: 2.6x the prefill rate at 512-token
    chunks, 2.8x at 2048; locking 4.1 GiB took 0.19 s); returns the bytes registered. Each block is unregistered
    when its layer's expert block is collected. A stack CUDA refuses stays pageable: copies still work."""
    cudart = torch.cuda.cudart()
    done = 0
    for layer in layers:
        moe = routed_block(layer)
        if moe is None or not offloadable(moe.gate_up, moe.down):
            continue
        pinned = []
        for stack in (moe.gate_up, moe.down):
            rows = _host_rows(stack)
            if rows.data_ptr() != stack[0].blocks.data_ptr():  # a copy: nothing to gain from pinning it
                continue
            if int(cudart.cudaHostRegister(rows.data_ptr(), rows.nbytes, 0)) == 0:
                pinned.append(rows.data_ptr())
                done += rows.nbytes
        if pinned:
            # Before the blocks' memory goes back to the allocator, which may hand it out again unregistered.
            weakref.finalize(moe, _unregister, pinned)
    return done


def _unregister(pointers: list[int]) -> None:
    cudart = torch.cuda.cudart()
    for ptr in pointers:
        cudart.cudaHostUnregister(ptr)


def routed_block(layer: object) -> Any:
    """A decoder layer's routed expert block (moe.SparseMoe): its `moe` (experts instead of the MLP), or the one
    inside its `experts` (Gemma 4's, beside the MLP); None for a layer without experts. Looked up by name: moe.py
    imports this module."""
    block = getattr(layer, "moe", None)
    return block if block is not None else getattr(getattr(layer, "experts", None), "moe", None)


def offloads(layers: Iterable[Any]) -> bool:
    """Whether any of a model's layers brings its experts from host RAM to a GPU for long batches (the shared
    SparseMoe's experts held as file blocks beside a CUDA layer)."""
    for layer in layers:
        moe = routed_block(layer)
        router = getattr(moe, "router", None)  # by name: Nemotron-H's block has up and down stacks, no gate_up
        if (isinstance(router, torch.Tensor) and router.device.type == "cuda"
                and offloadable(getattr(moe, "gate_up", None), getattr(moe, "down", None))):
            return True
    return False
