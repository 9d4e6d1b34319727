"""Decode steps captured in CUDA graphs: one replay per step instead of a dozen kernel launches per layer.

A step whose chunks are all one token (every slot decoding, or a prompt's last token computed alone) runs
`decode_step` over static buffers: the token ids, positions and slots of the rows are copied into a device
tensor, the step's graph is replayed, and its logits are copied out. Graphs are captured lazily, one per
(batch bucket, attention length bucket): rows are padded up to the next batch bucket (1, 2, 4, ... up to
--parallel; with speculation up to --parallel x (--spec-draft-max + 1), a slot's token and its drafts being
several rows of it: engine/model/graph_verify.py) and attention reads the first `length` rows of each slot, masked past the row's position, with
`length` the next power of two from 256 (capped at the context) above the step's last position. Pad rows
repeat the first row's slot at position ctx - 1, a row no valid K/V lives at while that slot decodes below it
(a step with a row at ctx - 1 runs eagerly), and their logits are dropped.

Everything else stays eager in `CausalLM.forward_chunks`: prefill chunks, mixed steps, models on several
devices, CPU 4-bit weights (CUDA 4-bit ones, `engine.model.gpu_weights`, are captured), and mixture-of-experts
layers whose experts cannot run as grouped GEMMs (experts in host RAM, or not bfloat16 on an sm90 / sm100 GPU:
the per-expert loop reads token counts back to the host); the grouped ones (engine/model/moe.py) are captured.

The captured function is plain PyTorch and runs as well without capture (`capture=False`, any device): the
graph computes bit for bit what that eager run computes, which is how the GPU check compares them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F

from engine.kv import KVBuffers
from engine.model import executors
from engine.model.decoder_layer import DecoderLayer
from engine.model.llama import CausalLM, SeqChunk, rms_norm
from engine.model.projections import logit_rows

MIN_ATTENTION_LENGTH = 256


def batch_buckets(max_batch: int) -> list[int]:
    """Row counts a graph is captured for: powers of two below `max_batch`, then `max_batch`."""
    assert max_batch >= 1, max_batch
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return [*out, max_batch]


def length_buckets(ctx: int) -> list[int]:
    """Attention lengths a graph is captured for: powers of two from MIN_ATTENTION_LENGTH below `ctx`, then ctx."""
    assert ctx >= 1, ctx
    out, n = [], MIN_ATTENTION_LENGTH
    while n < ctx:
        out.append(n)
        n *= 2
    return [*out, ctx]


def bucket(n: int, buckets: list[int]) -> int:
    """The smallest bucket that holds `n`."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


# Why this model's decode cannot be captured (None: it can); with the other executors' gates in executors.py.
unsupported = executors.graph_step_declines


class _Tables:
    """What every captured step reads besides the inputs: cos/sin per position (sin in forward_chunks'
    rolled-sign form) and 0..ctx-1, held here so the graphs' pointers stay valid when RotaryTable grows."""

    def __init__(self, model: CausalLM, ctx: int, device: torch.device) -> None:
        cos, sin = model.rotary.get(ctx, device, model.dtype)
        half = cos.shape[-1] // 2  # of the rotated channels (all of a head's, or partial RoPE's leading ones)
        self.cos = cos[:ctx]
        self.sin = torch.cat((-sin[:ctx, :half], sin[:ctx, half:]), dim=-1)
        self.arange = torch.arange(ctx, device=device)


def decode_step(
    model: CausalLM, kv: KVBuffers, tables: _Tables, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
    length: int,
) -> torch.Tensor:
    """One token per row: writes each row's K/V at (slot, pos) and returns float32 logits [rows, vocab].

    Attention reads rows [0, length) of each row's slot, masked past its position; `length` must exceed
    every real row's position. No host synchronisation, fixed shapes: capturable."""
    c = model.config
    n = ids.shape[0]
    H, D = c.n_heads, c.head_dim
    cos, sin = tables.cos[pos].unsqueeze(1), tables.sin[pos].unsqueeze(1)
    mask = (tables.arange[:length].unsqueeze(0) <= pos.unsqueeze(1)).view(n, 1, 1, length)
    assert isinstance(model.embed, torch.Tensor)  # blocks are kept on the CPU only (quant_embedding.py)
    x = F.embedding(ids, model.embed)
    for li in range(c.n_layers):
        layer = cast(DecoderLayer, model.layers[li])
        if layer.mla is not None:  # the latent rows (engine/model/mla.py)
            attn = layer.mla.decode_rows(layer, x, kv.layer(li), cos, sin, pos, slots, mask, length,
                                         not model.batch_invariant)
            x = model.attention_out_and_mlp(layer, x, attn, n)
            continue
        q, k, v = model.qkv(layer, x, cos, sin, n, n)
        k_cache, v_cache = kv.layer(li)
        k_cache.index_put_((slots, pos), k)
        v_cache.index_put_((slots, pos), v)
        # [rows, KVH, length, D], gathered contiguous: the products below then take every row count the same
        # way (a gathered [rows, length, KVH, D] made them copy it again for several rows, not for one, and one
        # row got other bits than the same row beside others)
        keys = k_cache[:, :length].transpose(1, 2).index_select(0, slots)
        values = v_cache[:, :length].transpose(1, 2).index_select(0, slots)
        x = model.attention_out_and_mlp(layer, x, masked_attention(q, keys, values, mask).reshape(n, H * D), n)
    h = rms_norm(x, model.norm, model.description.final_norm_eps)
    return logit_rows(h, model.lm_head, fast=not model.batch_invariant).float()


def masked_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [rows, H, D] against keys/values [rows, KVH, length, D] where mask [rows, 1, 1, length] -> [rows, H, D].

    Two batched products and a float32 softmax, not SDPA: SDPA's choice for this shape on an H200 (cuDNN)
    gave other bits from run to run on the same inputs (greedy tokens parted after 16-80 steps at 8 rows),
    and its math path was slower; cuBLAS's batched products are reproducible."""
    rows, H, D = q.shape
    kv_heads = keys.shape[1]
    grouped = q.reshape(rows, kv_heads, H // kv_heads, D) * D**-0.5
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).float().masked_fill(~mask, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values)  # [rows, KVH, G, D]
    return out.reshape(rows, H, D)


class GraphDecode:
    """Runs CausalLM.forward_chunks' all-one-token steps through captured graphs (see the module docstring).

    Bound to one KVBuffers at a time (the graphs hold its addresses): a step over another one re-binds and
    captures again."""

    owns_one_token_rows = False  # it runs forward_chunks' own arithmetic

    def __init__(self, model: CausalLM, max_batch: int, *, capture: bool = True) -> None:
        reason = executors.graph_step_declines(model) if capture else None
        assert reason is None, f"decode graphs: {reason}"
        self.model = model
        self.max_batch = max_batch
        self.slot_rows = max_batch  # the most rows of steps with one row per slot
        self.capture = capture
        self.device = model.stages[0][0]
        self.batches = batch_buckets(max_batch)
        self.verifies = False  # steps with a slot's several rows (graph_verify.py), once widened for them
        self._kv: KVBuffers | None = None
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.captures = 0
        self.replays = 0

    def widen(self, rows: int) -> None:
        """Capture steps of up to `rows` rows, several of them a slot's (a verify step's: graph_verify.py), besides
        the buckets of one row per slot; `widen(0)` goes back to those. The graphs so far are dropped."""
        self.verifies = rows > 0
        self.max_batch = max(rows, self.slot_rows)
        self.batches = sorted(set(batch_buckets(self.slot_rows)) | set(batch_buckets(self.max_batch)))
        self._graphs.clear()
        self._kv = None  # the inputs buffer is sized by max_batch: re-bound on the next step

    def _bind(self, kv: KVBuffers) -> None:
        self._graphs.clear()
        self._kv = kv
        self.lengths = length_buckets(kv.ctx)
        self._tables = _Tables(self.model, kv.ctx, self.device)
        self._inputs = torch.zeros(3, self.max_batch, dtype=torch.int64, device=self.device)  # ids, pos, slots
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None

    def plan(self, chunks: list[SeqChunk], kv: KVBuffers) -> tuple[int, int] | None:
        """(batch bucket, attention length) for this step, or None when it is not a capturable step."""
        if len(chunks) > self.max_batch or any(ch.tokens.numel() != 1 for ch in chunks):
            return None
        if not self.verifies and len({ch.slot for ch in chunks}) != len(chunks):  # a slot's several rows
            return None
        last = max(ch.start for ch in chunks)
        if last >= kv.ctx - 1:  # the pad rows' position
            return None
        return bucket(len(chunks), self.batches), bucket(last + 1, length_buckets(kv.ctx))

    def run(self, chunks: list[SeqChunk], kv: KVBuffers) -> torch.Tensor | None:
        """Logits [len(chunks), vocab] of a step of one-token chunks (in chunk order), or None to decline."""
        planned = self.plan(chunks, kv)
        if planned is None:
            return None
        if kv is not self._kv:
            self._bind(kv)
        rows, length = planned
        n = len(chunks)
        pad = rows - n
        ids = [int(ch.tokens[0]) for ch in chunks] + [0] * pad
        pos = [ch.start for ch in chunks] + [kv.ctx - 1] * pad
        slots = [ch.slot for ch in chunks] + [chunks[0].slot] * pad
        kv.flush()  # restored rows still in staging: a replay does not pass through KVBuffers.layer
        self._inputs[:, :rows].copy_(torch.tensor([ids, pos, slots], dtype=torch.int64))
        logits = self._execute(rows, length)
        self.replays += 1
        return logits[:n].clone()

    def _execute(self, rows: int, length: int) -> torch.Tensor:
        """Run the step over the inputs in place: replay its graph (captured on first use), or run it eagerly."""
        step = self._step_fn(rows, length)
        if not self.capture:
            return step()
        entry = self._graphs.get((rows, length))
        if entry is None:
            entry = self._capture(step)
            self._graphs[(rows, length)] = entry
        graph, logits = entry
        graph.replay()
        return logits

    def _step_fn(self, rows: int, length: int) -> Callable[[], torch.Tensor]:
        kv, tables, inputs = self._kv, self._tables, self._inputs
        assert kv is not None

        def step() -> torch.Tensor:
            return decode_step(self.model, kv, tables, inputs[0, :rows], inputs[1, :rows], inputs[2, :rows], length)

        return step

    def _capture(self, step: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            step()  # warm-up outside the capture: library handles, workspaces, kernel selection
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a restore's copies issued meanwhile by the reader thread (engine/kv/stream_upload.py) on
        # its own stream must not invalidate this capture, as they would under the default "global" mode.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            logits = step()
        self.captures += 1
        return graph, logits


def configure(model: object, max_batch: int, *, cuda_graphs: bool, deterministic: bool) -> str:
    """Set a model's decode mode from --no-cuda-graphs / --deterministic; returns the words for the log.

    CPU models keep their batch-invariant kernels whatever the flags (they are also the fast ones there)."""
    if not isinstance(model, CausalLM):
        return "decode: the model's own path"
    on_cuda = any(d.type == "cuda" for d, _, _ in model.stages)
    model.batch_invariant = deterministic or not on_cuda
    model.graphs = None
    if not on_cuda:
        from engine.model import cpu_decode, native_decode  # the same kernels with less Python per step

        native_reason = executors.native_step_declines(model)
        if native_reason is None:
            model.graphs = native_decode.NativeDecode(model)
            return "decode: CPU kernels (batch-invariant), one-token rows through the native step"
        reason = executors.cpu_step_declines(model)
        if reason is not None:
            return f"decode: CPU kernels (batch-invariant), through forward_chunks ({reason})"
        model.graphs = cpu_decode.CpuDecode(model)
        return f"decode: CPU kernels (batch-invariant), one-token steps through the lean CPU step ({native_reason})"
    mode = "batch-invariant per-row kernels" if deterministic else "one GEMM per projection over all rows"
    reason = "--deterministic" if deterministic else executors.graph_step_declines(model)
    if reason is not None:
        return f"decode: {mode}, without CUDA graphs ({reason})"
    # --no-cuda-graphs runs the very function a graph captures, launch by launch: the same results, slower.
    model.graphs = GraphDecode(model, max_batch, capture=cuda_graphs)
    if not cuda_graphs:
        return f"decode: {mode}, the captured step's kernels run one by one (--no-cuda-graphs)"
    buckets = ",".join(str(b) for b in batch_buckets(max_batch))
    return f"decode: {mode}, CUDA graphs for batches of {buckets} rows, captured on first use"
