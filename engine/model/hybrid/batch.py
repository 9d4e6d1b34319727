"""What one hybrid forward call runs: the chunks in row order, and the helpers every mixer shares.

Rows are laid out as in `engine.model.llama`: one-token chunks first (they take the per-row gemv path and,
in the recurrent mixers, one batched state update), then the longer chunks, each a contiguous row range.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.kv import KVBuffers
from engine.model.hybrid.recurrent_state import RecurrentStateBuffers
from engine.model.llama import SeqChunk

StepRows = Callable[[slice | torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(slots=True)
class Batch:
    chunks: list[SeqChunk]  # singles first
    offsets: list[int]  # rows of chunk i: [offsets[i], offsets[i + 1])
    n_single: int  # number of one-token chunks (= their rows, at the top)
    kv: KVBuffers
    state: RecurrentStateBuffers
    cos: torch.Tensor | None = None  # [total, 1, rotary_dim] for the current stage, None without RoPE
    sin: torch.Tensor | None = None
    _groups: list[list[int]] | None = None  # the one-token rows by wave (`_waves`), computed once per call
    _followed: set[int] = field(default_factory=set)  # one-token rows another row of their slot follows

    @property
    def total(self) -> int:
        return self.offsets[-1]

    def long_chunks(self) -> list[tuple[SeqChunk, int, int]]:
        """(chunk, first row, end row) of every chunk longer than one token."""
        return [(ch, self.offsets[i], self.offsets[i + 1]) for i, ch in enumerate(self.chunks) if i >= self.n_single]

    def initial(self, part: torch.Tensor, chunk: SeqChunk) -> torch.Tensor:
        """A chunk's starting state for one part: zeros for a fresh sequence, else the slot's stored state."""
        if chunk.start == 0:
            return torch.zeros_like(part[chunk.slot])
        return part[chunk.slot].clone()

    def step_singles(self, part: torch.Tensor, layer: int, name: str, step: StepRows) -> None:
        """Advance part (`layer`, `name`) of the state over the one-token rows: `step(rows, state)` gets the rows
        (a slice or an index tensor) and their slots' states before them ([m, ...], zero for a fresh sequence)
        and returns the states after them. A slot's several rows (a speculative verify: its last token and the
        draft's) run in order, one per call, each from the state its previous row left; the state after a row
        that another of its slot's rows follows is captured when the slot asked for it (a drafted position
        that may become the last accepted one)."""
        for rows in self._waves():
            chunks = [self.chunks[r] for r in rows]
            index: slice | torch.Tensor = (slice(rows[0], rows[-1] + 1) if rows[-1] - rows[0] + 1 == len(rows)
                                           else torch.tensor(rows, dtype=torch.int64, device=part.device))
            slots = torch.tensor([ch.slot for ch in chunks], dtype=torch.int64, device=part.device)
            before = part.index_select(0, slots)
            fresh = [i for i, ch in enumerate(chunks) if ch.start == 0]
            if fresh:
                before[fresh] = 0
            after = step(index, before)
            part.index_copy_(0, slots, after.to(part.dtype))
            for i, (r, ch) in enumerate(zip(rows, chunks, strict=True)):
                if r in self._followed and self.state.wants(ch.slot, ch.start + 1):
                    self.state.capture(ch.slot, ch.start + 1, layer, name, after[i])

    def _waves(self) -> list[list[int]]:
        """The one-token rows in groups holding at most one row of each slot, a slot's rows in position order
        (one group when every slot has one row: a plain decode step)."""
        if self._groups is None:
            groups: list[list[int]] = []
            seen: dict[int, int] = {}  # slot -> rows of it so far
            last: dict[int, int] = {}  # slot -> its latest row
            followed: set[int] = set()
            for r in range(self.n_single):
                slot = self.chunks[r].slot
                w = seen.get(slot, 0)
                seen[slot] = w + 1
                if w:
                    followed.add(last[slot])
                last[slot] = r
                if w == len(groups):
                    groups.append([])
                groups[w].append(r)
            self._groups, self._followed = groups, followed
        return self._groups


def segment_edges(start: int, end: int, block: int, cuts: list[int]) -> list[int]:
    """Edges of the scan segments of a chunk [start, end): block boundaries at absolute multiples of `block`
    (so a prefill chunked at multiples of `block` scans the same blocks as a one-shot prefill) and the
    requested checkpoint positions; always ends with `end`."""
    first = (start // block + 1) * block
    edges = set(range(first, end, block)) | {p for p in cuts if start < p < end} | {end}
    return sorted(edges)


def causal_conv(full: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Depthwise causal convolution over rows: `full` [..., K-1+n, C] (the previous K-1 inputs, then n new
    ones), `weight` [C, K] -> [..., n, C]. A fixed sum over the K taps, so a one-token decode step and a
    long chunk compute each output the same way (chunked prefill = one-shot, bit for bit)."""
    k = weight.shape[1]
    n = full.shape[-2] - (k - 1)
    out = full[..., 0:n, :] * weight[:, 0]
    for j in range(1, k):
        out = out + full[..., j : j + n, :] * weight[:, j]
    if bias is not None:
        out = out + bias
    return out


def conv_rows_at(full: torch.Tensor, k: int, rel: int) -> torch.Tensor:
    """The conv state after `rel` of the chunk's new rows: the K-1 inputs before that position."""
    return full[rel : rel + k - 1]


def apply_conv(
    u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: int, batch: Batch
) -> torch.Tensor:
    """The short causal convolution of recurrent layer `layer` over every chunk's rows `u` [total, C],
    carrying each slot's "conv" state (the last K-1 inputs) across calls and capturing it at checkpoints."""
    state = batch.state
    part = state.part(layer, "conv")
    k = weight.shape[1]
    out = torch.empty_like(u)
    n = batch.n_single
    if n:
        def step(rows: slice | torch.Tensor, before: torch.Tensor) -> torch.Tensor:
            full = torch.cat((before.to(u.dtype), u[rows].unsqueeze(1)), dim=1)  # [m, K, C]
            out[rows] = causal_conv(full, weight, bias)[:, 0]
            return full[:, 1:]

        batch.step_singles(part, layer, "conv", step)
    for ch, lo, hi in batch.long_chunks():
        full = torch.cat((batch.initial(part, ch).to(u.dtype), u[lo:hi]))
        out[lo:hi] = causal_conv(full, weight, bias)
        part[ch.slot] = full[hi - lo :].to(part.dtype)
        for p in state.wanted(ch.slot, ch.start, ch.start + hi - lo):
            state.capture(ch.slot, p, layer, "conv", conv_rows_at(full, k, p - ch.start))
    return out


def segment_decay(log_decay: torch.Tensor) -> torch.Tensor:
    """exp(sum of log_decay over (s, t]) for s <= t, else 0: [..., L] -> [..., L(t), L(s)].

    Summed per segment rather than as a difference of two running sums: over a block the running sum
    reaches hundreds, and the difference of two such sums would lose the small decays to rounding."""
    n = log_decay.shape[-1]
    x = log_decay.unsqueeze(-1).expand(*log_decay.shape, n)  # x[..., t, s] = log_decay[t]
    keep = torch.ones(n, n, dtype=torch.bool, device=x.device).tril(-1)
    seg = x.masked_fill(~keep, 0).cumsum(-2)
    upper = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
    return seg.masked_fill(upper, float("-inf")).exp()


_LANES = 32  # two AVX-512 vectors of float32: PyTorch's CPU loops step by two vectors, the rest runs scalar


def lanewise(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an elementwise transcendental `fn` on a [..., width] tensor with a small width (per-head
    gates), computed so each row's result does not depend on the row count: PyTorch's CPU kernels compute
    the tail of a tensor with scalar code that can differ from the vector code by an ulp, and which elements
    fall in the tail depends on how many rows are batched. Rows padded to a multiple of `_LANES` never do."""
    width = x.shape[-1]
    pad = (-width) % _LANES
    if x.device.type != "cpu" or (pad == 0 and x.is_contiguous()):
        return fn(x)
    return fn(F.pad(x, (0, pad)))[..., :width]
