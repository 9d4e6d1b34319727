"""A lean CPU decode step: the ops of `CausalLM.forward_chunks` for a step of one-token rows, without its
general bookkeeping.

Measured on the bundled SmolLM2-135M (int4, 1 thread): of a ~16 ms decode step the 121 4-bit matmuls take
~8.6 ms and the ~50 small ops per layer (norms, RoPE, K/V writes, attention) far less than the rest, which is
Python: chunk sorting and checks, attention plans, the RoPE rows' gather, per-layer calls through `_layer`,
`qkv`, `linear` and `attention_out_and_mlp`, and `nn.Module` attribute lookups for every buffer. This runner
binds each layer's weights and K/V views once (per KVBuffers) and runs the same kernels on the same inputs in
the same order, so its logits are bit for bit those of forward_chunks (tests/test_cpu_decode.py checks it);
what it does not cover it declines, and forward_chunks runs the step: prefill chunks, mixed steps, sliding
Gemma, full-width q/k norms (OLMoE), experts, models on several devices, compute dtypes other than float32.
"""

from __future__ import annotations

from typing import NamedTuple, cast

import torch
import torch.nn.functional as F

from engine.kv import KVBuffers
from engine.model import executors
from engine.model.chunk_attention import decode_attention
from engine.model.decoder_layer import DecoderLayer
from engine.model.int4 import Int4Weight
from engine.model.kernels import RowsWeight
from engine.model.llama import CausalLM, SeqChunk, check_rows
from engine.model.norms import head_rms_norm, rms_norm
from engine.model.projections import linear, logit_rows
from engine.model.quant_embedding import embed_rows
from engine.model.sliding import first_key

# Why this model's decode steps stay on forward_chunks (None: this runner takes them); with the other
# executors' gates in executors.py.
unsupported = executors.cpu_step_declines


class _Layer(NamedTuple):
    attn_norm: torch.Tensor
    wqkv: torch.Tensor | Int4Weight | RowsWeight
    bqkv: torch.Tensor | None
    wo: torch.Tensor | Int4Weight | RowsWeight
    mlp_norm: torch.Tensor
    w_gate_up: torch.Tensor | Int4Weight | RowsWeight
    w_down: torch.Tensor | Int4Weight | RowsWeight
    qk_norm: torch.Tensor | None  # per-head q and k norms (Qwen3)
    window: int | None  # a sliding layer's window (engine/model/sliding.py)
    scale: float | None  # the softmax scale (None: 1/sqrt(head_dim))
    eps: float
    k_cache: torch.Tensor  # [n_slots, ctx, KVH, D]
    v_cache: torch.Tensor


def _project(x: torch.Tensor, w: torch.Tensor | Int4Weight | RowsWeight, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """`linear(x, w, n, bias)` for n one-token rows: a 4-bit weight's product taken directly (what linear
    returns for it without a bias), anything else through linear itself."""
    if bias is None and isinstance(w, Int4Weight):
        return w.mm(x)
    return linear(x, w, n, bias)


class CpuDecode:
    """Runs forward_chunks' steps of one-token rows on the CPU (module docstring); bound to one KVBuffers at a
    time, the layers' K/V views taken again when a step comes with another."""

    owns_one_token_rows = False  # it runs forward_chunks' own arithmetic
    batches: tuple[int, ...] = ()  # it captures nothing

    def __init__(self, model: CausalLM) -> None:
        reason = unsupported(model)
        assert reason is None, f"CPU decode step: {reason}"
        assert model.batch_invariant, "CPU kernels are batch-invariant; the fast GEMM path is CUDA's"
        self.model = model
        self._kv: KVBuffers | None = None
        self._layers: list[_Layer] = []
        self.steps = 0

    def _bind(self, kv: KVBuffers) -> None:
        m = self.model
        layers = cast(list[DecoderLayer], list(m.layers))
        self._layers = []
        for li, layer in enumerate(layers):
            assert layer.w_gate_up is not None and layer.w_down is not None  # dense (unsupported() checked)
            k_cache, v_cache = kv.layer(li)
            attention = layer.spec.attention
            self._layers.append(_Layer(layer.attn_norm, layer.wqkv, layer.bqkv, layer.wo, layer.mlp_norm,
                                       layer.w_gate_up, layer.w_down, layer.qk_norm, attention.window,
                                       attention.scale, layer.spec.norm.eps, k_cache, v_cache))
        self._kv = kv
        self._ctx = kv.ctx

    def run(self, chunks: list[SeqChunk], kv: KVBuffers) -> torch.Tensor | None:
        """Logits [len(chunks), vocab] (float32, chunk order) of a step of one-token rows, or None to decline."""
        if any(ch.tokens.numel() != 1 for ch in chunks):
            return None
        if kv is not self._kv:
            self._bind(kv)
        kv.flush()  # restored rows still in staging (CUDA only; a no-op here) before the views are read
        check_rows(chunks)
        for ch in chunks:
            assert 0 <= ch.start < self._ctx and 0 <= ch.slot < kv.n_slots, (ch.slot, ch.start, self._ctx)
        self.steps += 1
        return self._step(chunks)

    def _step(self, chunks: list[SeqChunk]) -> torch.Tensor:
        m, c = self.model, self.model.config
        H, KVH, D, inter = c.n_heads, c.n_kv_heads, c.head_dim, c.intermediate_size
        qk_w = (H + KVH) * D
        n = len(chunks)
        starts = [ch.start for ch in chunks]
        x = embed_rows(torch.cat([ch.tokens for ch in chunks]), m.embed)
        # forward_chunks' RoPE rows: cos[pos], and sin with its first half negated (the rolled-sign form).
        cos_t, sin_t = m.rotary.get(max(starts) + 1, x.device, m.dtype)
        pos = torch.tensor(starts, dtype=torch.int64)
        cos, sin = cos_t[pos].unsqueeze(1), sin_t[pos].unsqueeze(1)
        sin = torch.cat((-sin[..., : D // 2], sin[..., D // 2 :]), dim=-1)
        for layer in self._layers:
            eps = layer.eps
            h = rms_norm(x, layer.attn_norm, eps)
            qkv = _project(h, layer.wqkv, n, layer.bqkv)
            qk = qkv[:, :qk_w].view(n, H + KVH, D)
            v = qkv[:, qk_w:].view(n, KVH, D)
            if layer.qk_norm is not None:
                qk = head_rms_norm(qk.to(x.dtype), layer.qk_norm, eps)
            qk = qk * cos + qk.roll(D // 2, -1) * sin
            k_cache, v_cache = layer.k_cache, layer.v_cache
            outs = []
            for i, ch in enumerate(chunks):
                s, p = ch.slot, ch.start
                k_cache[s, p : p + 1] = qk[i : i + 1, H:]
                v_cache[s, p : p + 1] = v[i : i + 1]
                seen = first_key(p, layer.window)
                keys, values = k_cache[s, seen : p + 1].transpose(0, 1), v_cache[s, seen : p + 1].transpose(0, 1)
                if keys.dtype != qk.dtype:  # --kv-dtype narrower than float32 (as forward_chunks does)
                    keys, values = keys.to(qk.dtype), values.to(qk.dtype)
                outs.append(decode_attention(qk[i, :H], keys, values, layer.scale))
            attn = outs[0] if n == 1 else torch.stack(outs)
            x = x + _project(attn.reshape(n, H * D), layer.wo, n, None)
            h = rms_norm(x, layer.mlp_norm, eps)
            gate_up = _project(h, layer.w_gate_up, n, None)
            act = F.silu(gate_up[:, :inter].to(x.dtype)) * gate_up[:, inter:]
            x = x + _project(act, layer.w_down, n, None)
        return logit_rows(rms_norm(x, m.norm, m.description.final_norm_eps), m.lm_head).float()
