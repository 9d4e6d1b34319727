"""Speculative verify steps through the captured CUDA decode step (engine/model/graph_decode.py).

A verify step feeds a decoding slot's token and its draft's tokens as one-token rows of that slot at successive
positions. `decode_step` writes every row's K/V before any row attends and masks each row past its own
position, so a row sees the tokens before it as decoding them one per step would. For greedy answers to stay
token-identical with and without drafts, each row must also compute the same bits as in the step it would have
run in without drafts (the same slots beside it). Two things could change them; both are held fixed here:

1. The attention length. A step attends over the length bucket of its last row, so a slot's rows stop at the
   end of the bucket its first row is in (`VerifyRows.rows`): the step's length is the one without drafts.
2. The row count. cuBLAS picks its kernels by a product's shape, so whether a row gets the same bits in a
   product of 1 row and of n rows is the library's affair, not a guarantee. `check` runs, at start, a step of
   every captured row count against the same rows run one per step, and compares logits and K/V bit for bit;
   any difference declines speculation, naming it. That is every product at one attention length (256); the
   attention's own products are checked at every length bucket at the end of the warm-up
   (`attention_alike`, `VerifyRows.measure`), and drafts stop below the first length where a row differed.

A step with a prefill chunk runs eagerly (forward_chunks: one GEMM over its decode rows and the prompt's), which
`check` does not cover, so it feeds no drafts.

Memory: a captured step copies each row's slot K/V (rows x length positions per layer), so drafts multiply
that copy. `VerifyRows.rows` keeps a step's copy within the larger of what the step without drafts copies at
every slot's full context and half the GPU memory free after the warm-up.
"""

from __future__ import annotations

import logging

import torch

from engine.kv import KVBuffers
from engine.model.graph_decode import GraphDecode, bucket, length_buckets, masked_attention
from engine.model.llama import SeqChunk

log = logging.getLogger("strata.engine")


def check(graphs: GraphDecode, kv: KVBuffers) -> str:
    """'' when every captured row count computes each row's logits and K/V bit for bit as a step of that row
    alone does, else the first difference. Writes the rows of the first slots (the caller clears them)."""
    n = graphs.max_batch
    s = kv.n_slots
    # row i: slot i % s at position i // s, so a step holds several rows of a slot, as a verify step does
    if n // s + 1 >= min(kv.ctx - 1, length_buckets(kv.ctx)[0]):
        return f"a context of {kv.ctx} tokens is too short to check steps of {n} rows"
    ids = torch.randint(0, graphs.model.embed.shape[0], (n,), generator=torch.Generator().manual_seed(0))
    chunks = [SeqChunk(i % s, i // s, ids[i : i + 1]) for i in range(n)]
    singles = [graphs.run([ch], kv) for ch in chunks]
    assert all(r is not None for r in singles), "a one-row step is captured"
    alone = torch.cat(singles)  # type: ignore[arg-type]
    kv_alone = _rows(kv, n)
    for rows in graphs.batches[1:]:
        got = graphs.run(chunks[:rows], kv)
        assert got is not None, f"a step of {rows} rows is captured"
        for r in range(rows):
            if not torch.equal(got[r], alone[r]):
                return f"row {r} of a {rows}-row step got other logits than the same row alone"
        for li, (k, v) in enumerate(_rows(kv, rows)):
            if not (torch.equal(k, kv_alone[li][0][: k.shape[0]]) and torch.equal(v, kv_alone[li][1][: v.shape[0]])):
                return f"a {rows}-row step wrote other K/V in layer {li} than its rows alone"
    return ""


def _rows(kv: KVBuffers, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copies of the K/V `check`'s first `n` rows wrote, per layer, as [slots x positions] rows."""
    s = kv.n_slots
    depth = (n + s - 1) // s
    out = []
    for li in range(kv.layout.n_layers):
        k, v = kv.layer(li)
        # row i at (slot i % s, position i // s): positions major, so a step's first rows come first
        out.append(tuple(t[:s, :depth].transpose(0, 1).reshape(s * depth, -1)[:n].clone() for t in (k, v)))
    return out  # type: ignore[return-value]


def attention_alike(rows: list[int], length: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype,
                    device: torch.device) -> bool:
    """Whether the captured step's attention (`masked_attention`) gives each row the same bits in products of
    each of `rows` rows as alone, at `length` positions (random rows: kernels are chosen by shape, not values)."""
    n = max(rows)
    gen = torch.Generator(device=device).manual_seed(length)
    q = torch.randn(n, heads, dim, generator=gen, device=device, dtype=dtype)
    keys = torch.randn(n, kv_heads, length, dim, generator=gen, device=device, dtype=dtype)
    values = torch.randn(n, kv_heads, length, dim, generator=gen, device=device, dtype=dtype)
    pos = length - 1 - torch.arange(n, device=device) % max(length // 2, 1)  # rows near the bucket's end
    mask = (torch.arange(length, device=device).unsqueeze(0) <= pos.unsqueeze(1)).view(n, 1, 1, length)
    alone = torch.cat([masked_attention(q[i : i + 1], keys[i : i + 1], values[i : i + 1], mask[i : i + 1])
                       for i in range(n)])
    return all(torch.equal(masked_attention(q[:r], keys[:r], values[:r], mask[:r]), alone[:r]) for r in rows)


class VerifyRows:
    """How many rows (its token and its drafts) each decoding slot may feed a captured step.

    Measured at the end of the warm-up (ModelRunner.warm_up: the draft model, warmed up before it, and the
    model's graphs hold their memory by then; graphs of longer attention lengths come later, within the half of
    the free memory left out), or else at the first step that asks: the step's K/V copy budget, and the longest
    attention length bucket whose attention `attention_alike` finds row-invariant at every row count the budget
    allows there (`check` covers the rest of the step at 256)."""

    def __init__(self, graphs: GraphDecode, kv: KVBuffers, n_heads: int) -> None:
        self.graphs = graphs
        self.kv = kv
        self.ctx = kv.ctx
        self.lengths = length_buckets(kv.ctx)
        self.n_heads = n_heads
        self.budget = 0  # rows x length a step may gather (0: not measured yet)
        self.max_length = 0  # the longest length bucket a step with drafts may attend over

    def measure(self) -> None:
        layout, device = self.kv.layout, torch.device(self.graphs.device)
        # per gathered position and layer: K and V copied by the gather, the float32 scores, their softmax and
        # its copy in the K/V dtype
        per_position = (2 * layout.n_kv_heads * layout.head_dim + self.n_heads) * layout.dtype.itemsize
        per_position += 2 * self.n_heads * 4
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
        self.budget = max(self.kv.n_slots * self.ctx, free // 2 // per_position)
        self.max_length = 0  # measured again: from scratch
        for length in self.lengths:
            rows = [b for b in self.graphs.batches if b * length <= self.budget]
            try:
                alike = len(rows) < 2 or attention_alike(rows, length, self.n_heads, layout.n_kv_heads,
                                                         layout.head_dim, layout.dtype, device)
            except Exception:  # out of memory, say: no drafts from this length on, never a failed step
                log.exception("speculation: checking attention over %d positions failed", length)
                alike = False
            if not alike:
                log.warning("speculation: drafts stop at %d positions; attention over %d was not found to give "
                            "a row the same bits beside others as alone", self.max_length, length)
                break
            self.max_length = length
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the check's rows, not kept in the allocator's cache

    def rows(self, positions: list[int], prefilling: bool) -> list[int]:
        """The most rows each decoding slot (at `positions`, its next row's) may feed this step, at least one."""
        if prefilling or not positions:
            return [1] * len(positions)
        if not self.budget:
            self.measure()
        length = bucket(max(positions) + 1, self.lengths)
        if length > self.max_length:
            return [1] * len(positions)
        # each slot's rows end with its first row's length bucket (and before the pad rows' position, ctx - 1)
        own = [min(bucket(p + 1, self.lengths), self.ctx - 1) - p for p in positions]
        assert all(r >= 1 for r in own), (positions, own)
        total = len(positions)
        while total < self.graphs.max_batch:
            wider = bucket(total + 1, self.graphs.batches)
            if wider * length > self.budget:
                break
            total = min(wider, self.graphs.max_batch)
        out = []
        spare = total - len(positions)
        for r in own:
            extra = min(r - 1, spare)
            out.append(1 + extra)
            spare -= extra
        return out
