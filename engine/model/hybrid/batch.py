"""What one hybrid forward call runs: the chunks in row order, and the helpers every mixer shares.

Rows are laid out as in `engine.model.llama`: one-token chunks first (they take the per-row gemv path and,
in the recurrent mixers, one batched state update), then the longer chunks, each a contiguous row range.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kv import KVBuffers
from engine.model.hybrid.recurrent_state import RecurrentStateBuffers
from engine.model.llama import SeqChunk


@dataclass(slots=True)
class Batch:
    chunks: list[SeqChunk]  # singles first
    offsets: list[int]  # rows of chunk i: [offsets[i], offsets[i + 1])
    n_single: int  # number of one-token chunks (= their rows, at the top)
    kv: KVBuffers
    state: RecurrentStateBuffers
    cos: torch.Tensor | None = None  # [total, 1, rotary_dim] for the current stage, None without RoPE
    sin: torch.Tensor | None = None

    @property
    def total(self) -> int:
        return self.offsets[-1]

    def single_slots(self, device: torch.device) -> torch.Tensor:
        return torch.tensor([ch.slot for ch in self.chunks[: self.n_single]], dtype=torch.int64, device=device)

    def single_fresh(self, device: torch.device) -> torch.Tensor:
        """[n_single] bool: the one-token chunk starts a sequence (its state starts at zero)."""
        return torch.tensor([ch.start == 0 for ch in self.chunks[: self.n_single]], dtype=torch.bool, device=device)

    def long_chunks(self) -> list[tuple[SeqChunk, int, int]]:
        """(chunk, first row, end row) of every chunk longer than one token."""
        return [(ch, self.offsets[i], self.offsets[i + 1]) for i, ch in enumerate(self.chunks) if i >= self.n_single]

    def initial(self, part: torch.Tensor, chunk: SeqChunk) -> torch.Tensor:
        """A chunk's starting state for one part: zeros for a fresh sequence, else the slot's stored state."""
        if chunk.start == 0:
            return torch.zeros_like(part[chunk.slot])
        return part[chunk.slot].clone()

    def gather_singles(self, part: torch.Tensor) -> torch.Tensor:
        """The stored state of every one-token chunk's slot, [n_single, ...], zero for fresh sequences."""
        slots = self.single_slots(part.device)
        out = part.index_select(0, slots)
        fresh = self.single_fresh(part.device)
        if bool(fresh.any()):
            out[fresh] = 0
        return out

    def scatter_singles(self, part: torch.Tensor, value: torch.Tensor) -> None:
        part.index_copy_(0, self.single_slots(part.device), value.to(part.dtype))


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
        full = torch.cat((batch.gather_singles(part).to(u.dtype), u[:n].unsqueeze(1)), dim=1)  # [n, K, C]
        out[:n] = causal_conv(full, weight, bias)[:, 0]
        batch.scatter_singles(part, full[:, 1:])
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
