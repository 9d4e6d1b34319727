"""Preallocated K/V buffers: one contiguous region per slot, per layer, on the device that owns the layer.

Layout per stage: k and v are [n_stage_layers, n_slots, ctx, n_kv_heads, head_dim]. Token-major rows make a
run of tokens of one slot and one layer a single contiguous span, so the conversation cache captures and
restores with plain copies. Keys are stored after RoPE, so a token's K/V depends only on the tokens before it
and its absolute position: a prefix restored at the same positions is exactly what a prefill would compute.

The cache sees K/V only through `read` and `write`, in a stage-independent layout
[n_layers, 2, n_tokens, n_kv_heads, head_dim] on the CPU: a conversation parked under one layer split restores
under any other, or on one device.
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.kv.host_memory import lazy_zeros, populate, zero_span
from engine.kv.pinned_staging import PinnedStaging


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The shape of one token's K/V across all layers; part of a parked conversation's identity."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        return self.n_layers * 2 * self.n_kv_heads * self.head_dim * self.dtype.itemsize

    def host_shape(self, n_tokens: int) -> tuple[int, ...]:
        """Shape of `n_tokens` tokens' K/V in the stage-independent host layout."""
        return (self.n_layers, 2, n_tokens, self.n_kv_heads, self.head_dim)

    def describe(self) -> dict:
        return {
            "n_layers": self.n_layers,
            "n_kv_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "dtype": str(self.dtype).removeprefix("torch."),
        }


@dataclass(slots=True)
class Stage:
    """The contiguous layers [first_layer, end_layer) that live on one device, with their K/V.

    The counters add up the time and bytes of every `read` (park) and `write` (restore) per stage, for the
    per-stage figures benchmarks report.
    """

    device: torch.device
    first_layer: int
    end_layer: int
    k: torch.Tensor
    v: torch.Tensor
    read_s: float = 0.0
    read_bytes: int = 0
    write_s: float = 0.0
    write_bytes: int = 0


class KVBuffers:
    """K/V for `n_slots` slots of `ctx` tokens, split into stages by layer ranges."""

    def __init__(
        self,
        layout: KVLayout,
        n_slots: int,
        ctx: int,
        stages: Sequence[tuple[torch.device | str, int, int]],
    ) -> None:
        assert stages and stages[0][1] == 0 and stages[-1][2] == layout.n_layers, "stages must cover every layer"
        for (_, _, end), (_, first, _) in zip(stages, stages[1:], strict=False):
            assert end == first, "stages must be contiguous"
        self.layout = layout
        self.n_slots = n_slots
        self.ctx = ctx
        self.stages: list[Stage] = []
        self._maps: dict[int, mmap.mmap | None] = {}  # id of a CPU stage's k or v -> the map behind it
        for device, first, end in stages:
            device = torch.device(device)
            shape = (end - first, n_slots, ctx, layout.n_kv_heads, layout.head_dim)
            if device.type == "cpu":  # resident only as rows are written: see host_memory
                (k, k_map), (v, v_map) = lazy_zeros(shape, layout.dtype), lazy_zeros(shape, layout.dtype)
                self._maps[id(k)], self._maps[id(v)] = k_map, v_map
            else:
                k = torch.zeros(shape, dtype=layout.dtype, device=device)
                v = torch.zeros(shape, dtype=layout.dtype, device=device)
            self.stages.append(Stage(device, first, end, k, v))
        self._staging: dict[torch.device, PinnedStaging] = {}
        for stage in self.stages:
            if stage.device.type == "cuda" and stage.device not in self._staging:
                self._staging[stage.device] = PinnedStaging(stage.device)
        self._stage_of_layer = [i for i, s in enumerate(self.stages) for _ in range(s.first_layer, s.end_layer)]

    @property
    def nbytes(self) -> int:
        return sum(s.k.nbytes + s.v.nbytes for s in self.stages)

    def flush(self) -> None:
        """Send restored rows still gathered in staging, so what reads the buffers next sees them."""
        for staging in self._staging.values():
            if staging.pending:
                staging.flush()

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer for all slots: two [n_slots, ctx, n_kv_heads, head_dim] views on its device."""
        self.flush()
        stage = self.stages[self._stage_of_layer[layer]]
        i = layer - stage.first_layer
        return stage.k[i], stage.v[i]

    def read(self, slot: int, start: int, end: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy tokens [start, end) of `slot` to host memory, layout [n_layers, 2, end-start, kv_heads, head_dim]."""
        assert 0 <= slot < self.n_slots and 0 <= start <= end <= self.ctx, (slot, start, end)
        n = end - start
        self.flush()
        if out is None:
            out = torch.empty(self.layout.host_shape(n), dtype=self.layout.dtype)
        assert tuple(out.shape) == self.layout.host_shape(n) and out.dtype == self.layout.dtype
        for stage in self.stages:
            t0 = time.perf_counter()
            lo, hi = stage.first_layer, stage.end_layer
            staging = self._staging.get(stage.device)
            if staging is None:
                out[lo:hi, 0].copy_(stage.k[:, slot, start:end])
                out[lo:hi, 1].copy_(stage.v[:, slot, start:end])
            else:
                staging.to_host(out[lo:hi, 0], stage.k[:, slot, start:end])
                staging.to_host(out[lo:hi, 1], stage.v[:, slot, start:end])
            stage.read_s += time.perf_counter() - t0
            stage.read_bytes += out[lo:hi].nbytes
        return out

    def write(self, slot: int, start: int, data: torch.Tensor, *, wait: bool = True) -> None:
        """Copy host K/V in the `read` layout into tokens [start, start + n) of `slot`, stage by stage.

        With `wait=False`, transfers to a GPU may still be pending on return (`data` is already copied into
        pinned staging, consecutive rows of a slot gathered into one transfer): a restore of many blocks queues
        them all and waits once (`synchronize()`); anything that reads the buffers first (`layer`, `read`,
        `clear`) sends what is gathered before it.
        """
        n = data.shape[2]
        assert 0 <= slot < self.n_slots and start >= 0 and start + n <= self.ctx, (slot, start, n)
        assert tuple(data.shape) == self.layout.host_shape(n), (tuple(data.shape), self.layout.host_shape(n))
        assert data.dtype == self.layout.dtype, (data.dtype, self.layout.dtype)
        for stage in self.stages:
            t0 = time.perf_counter()
            lo, hi = stage.first_layer, stage.end_layer
            staging = self._staging.get(stage.device)
            if staging is None:
                stage.k[:, slot, start : start + n].copy_(data[lo:hi, 0])
                stage.v[:, slot, start : start + n].copy_(data[lo:hi, 1])
            else:
                staging.queue(stage.k, slot, start, data[lo:hi, 0])
                staging.queue(stage.v, slot, start, data[lo:hi, 1])
                if wait:
                    staging.synchronize()
            stage.write_s += time.perf_counter() - t0
            stage.write_bytes += data[lo:hi].nbytes

    def synchronize(self) -> None:
        """Wait for every queued transfer into the GPU stages (the time counts as the last stage's)."""
        t0 = time.perf_counter()
        for staging in self._staging.values():
            staging.synchronize()
        if self._staging:
            self.stages[-1].write_s += time.perf_counter() - t0

    def populate(self, slot: int, start: int, end: int) -> None:
        """Fault in the host pages of tokens [start, end) of `slot` (CPU stages), so restoring into them is a plain
        memcpy. Any thread (a restore reader): it changes no byte, and no other slot's rows. GPU stages: nothing."""
        assert 0 <= slot < self.n_slots and 0 <= start <= end <= self.ctx, (slot, start, end)
        for stage in self.stages:
            if stage.device.type != "cpu":
                continue
            for t in (stage.k, stage.v):
                if self._maps.get(id(t)) is None:
                    continue
                for layer in range(t.shape[0]):
                    if not populate(t[layer, slot, start:end]):
                        return

    def clear(self, slot: int) -> None:
        """Zero a slot (used after a failed restore so no half-written state can be attended to); on the CPU
        its pages go back to the kernel, so an erased slot holds no resident memory."""
        self.flush()
        for stage in self.stages:
            for t in (stage.k, stage.v):
                if stage.device.type != "cpu":
                    t[:, slot].zero_()
                    continue
                for layer in range(t.shape[0]):
                    zero_span(t, self._maps.get(id(t)), t[layer, slot])
