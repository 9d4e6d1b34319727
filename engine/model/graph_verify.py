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
   any difference declines speculation, naming it.

A step with a prefill chunk runs eagerly (forward_chunks: one GEMM over its decode rows and the prompt's), which
`check` does not cover, so it feeds no drafts.

Memory: a captured step copies each row's slot K/V (rows x length positions per layer), so drafts multiply
that copy. `VerifyRows.rows` keeps a step's copy within the larger of what the step without drafts copies at
every slot's full context and half the GPU memory free after the check.
"""

from __future__ import annotations

import torch

from engine.kv import KVBuffers
from engine.model.graph_decode import GraphDecode, bucket, length_buckets
from engine.model.llama import SeqChunk


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


class VerifyRows:
    """How many rows (its token and its drafts) each decoding slot may feed a captured step."""

    def __init__(self, graphs: GraphDecode, kv: KVBuffers, n_heads: int) -> None:
        self.graphs = graphs
        self.ctx = kv.ctx
        self.lengths = length_buckets(kv.ctx)
        layout = kv.layout
        # per gathered position and layer: K and V copied by the gather, the float32 scores, their softmax and
        # its copy in the K/V dtype
        per_position = (2 * layout.n_kv_heads * layout.head_dim + n_heads) * layout.dtype.itemsize + 2 * n_heads * 4
        device = graphs.device
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
        self.budget = max(kv.n_slots * kv.ctx, free // 2 // per_position)  # rows x length, gathered in a step

    def rows(self, positions: list[int], prefilling: bool) -> list[int]:
        """The most rows each decoding slot (at `positions`, its next row's) may feed this step, at least one."""
        if prefilling or not positions:
            return [1] * len(positions)
        length = bucket(max(positions) + 1, self.lengths)
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
