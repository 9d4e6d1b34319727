"""The attention layers of hybrid models, over the existing K/V buffers (one K/V layer per attention layer).

Variants by config: q/k RMSNorm over head_dim (LFM2, Qwen3.5), partial RoPE on the leading `rotary_dim`
channels of a head (Qwen3.5) or none at all (Granite-4.0-H is NoPE), a sigmoid output gate whose rows sit
interleaved with the query rows per head in q_proj (Qwen3.5), and a custom softmax scale (Granite).
Keys are stored after RoPE, as in `engine.model.llama`, so the cache treats these K/V rows like any other.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.hybrid.batch import Batch
from engine.model.hybrid.config import HybridConfig
from engine.model.layers import AttentionSpec, RopeSpec
from engine.model.projections import linear


def attention_spec(config: HybridConfig) -> AttentionSpec:
    """The layer description (engine/model/layers.py) of a hybrid model's attention layers: full attention,
    per-head q/k norms or none, RoPE on the leading `rotary_dim` channels (0: none), an explicit scale, and
    Qwen3.5's output gate."""
    c = config
    return AttentionSpec(
        window=None, rope=RopeSpec(theta=c.rope_theta, scaling=c.rope_scaling, local=False),
        qk_norm="head" if c.qk_norm else "none", scale=c.softmax_scale, bias=False,
        rotary_dim=None if c.rotary_dim == c.head_dim else c.rotary_dim, output_gate=c.attention_gate,
    )


class AttentionMixer(torch.nn.Module):
    # The buffers registered in __init__, typed (nn.Module's attribute lookup is typed Tensor | Module).
    wqkv: torch.Tensor
    wo: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None

    def __init__(
        self,
        config: HybridConfig,
        kv_index: int,
        *,
        wqkv: torch.Tensor,
        wo: torch.Tensor,
        q_norm: torch.Tensor | None = None,
        k_norm: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        c = config
        self.spec = spec = attention_spec(config)  # what forward reads about this layer's variant
        q_rows = c.n_heads * c.head_dim * (2 if spec.output_gate else 1)
        kv_rows = c.n_kv_heads * c.head_dim
        assert wqkv.shape == (q_rows + 2 * kv_rows, c.hidden_size), ("wqkv", tuple(wqkv.shape))
        assert wo.shape == (c.hidden_size, c.n_heads * c.head_dim), ("wo", tuple(wo.shape))
        assert (q_norm is None) == (k_norm is None) == (spec.qk_norm == "none"), "q/k norms must match the spec"
        self.config = config
        self.kv_index = kv_index
        self.q_rows = q_rows
        self.register_buffer("wqkv", wqkv, persistent=False)
        self.register_buffer("wo", wo, persistent=False)
        self.register_buffer("q_norm", q_norm, persistent=False)
        self.register_buffer("k_norm", k_norm, persistent=False)

    def project(
        self, h: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, n_single: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The rows' queries [n, H, D], keys and values [n, KVH, D] (normed, RoPE'd with `cos`/`sin` [n, 1, rd]
        where given) and output gate [n, H * D] (None without one): what `forward` attends with, and the
        next-token layer of these families too (engine/model/mtp_attention.py)."""
        c, spec = self.config, self.spec
        H, KVH, D = c.n_heads, c.n_kv_heads, c.head_dim
        total = h.shape[0]
        qkv = linear(h, self.wqkv, n_single)
        gate = None
        if spec.output_gate:
            qg = qkv[:, : self.q_rows].view(total, H, 2 * D)
            q, gate = qg[..., :D], qg[..., D:].reshape(total, H * D)
        else:
            q = qkv[:, : self.q_rows].view(total, H, D)
        k = qkv[:, self.q_rows : self.q_rows + KVH * D].view(total, KVH, D)
        v = qkv[:, self.q_rows + KVH * D :].view(total, KVH, D)
        if self.q_norm is not None:
            assert self.k_norm is not None  # the norms come in pairs (asserted in __init__)
            q = _rms(q, self.q_norm, c.rms_norm_eps)
            k = _rms(k, self.k_norm, c.rms_norm_eps)
        if cos is not None:
            assert sin is not None  # cos and sin are set together
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        return q, k, v, gate

    def forward(self, h: torch.Tensor, batch: Batch) -> torch.Tensor:
        c, spec = self.config, self.spec
        H, KVH, D = c.n_heads, c.n_kv_heads, c.head_dim
        total, n_single = batch.total, batch.n_single
        q, k, v, gate = self.project(h, batch.cos, batch.sin, n_single)
        k_cache, v_cache = batch.kv.layer(self.kv_index)
        scale = spec.scale
        assert scale is not None  # attention_spec states it
        attn = torch.empty(total, H, D, dtype=h.dtype, device=h.device)
        for i, ch in enumerate(batch.chunks):
            lo, hi = batch.offsets[i], batch.offsets[i + 1]
            end = ch.start + (hi - lo)
            k_cache[ch.slot, ch.start : end] = k[lo:hi]
            v_cache[ch.slot, ch.start : end] = v[lo:hi]
            keys, values = k_cache[ch.slot, :end].transpose(0, 1), v_cache[ch.slot, :end].transpose(0, 1)
            if keys.dtype != q.dtype:  # --kv-dtype narrower than the compute dtype: attend in the compute dtype
                keys, values = keys.to(q.dtype), values.to(q.dtype)
            if hi - lo == 1:
                attn[lo] = _one_query(q[lo], keys, values, scale)
                continue
            if ch.start and h.device.type == "cpu":  # after earlier rows (a resumed conversation, a later chunk)
                attn[lo:hi] = _chunk_queries(q[lo:hi], keys, values, ch.start, scale)
                continue
            mask = None
            if ch.start:  # on CUDA the caching allocator reuses the copies below without faulting pages in
                rows = torch.arange(ch.start, end, device=h.device).unsqueeze(1)
                mask = torch.arange(end, device=h.device).unsqueeze(0) <= rows
            groups = H // KVH
            kk = keys.repeat_interleave(groups, 0) if groups > 1 else keys
            vv = values.repeat_interleave(groups, 0) if groups > 1 else values
            out = F.scaled_dot_product_attention(
                q[lo:hi].transpose(0, 1), kk, vv, attn_mask=mask, is_causal=mask is None, scale=scale
            )
            attn[lo:hi] = out.transpose(0, 1)
        out = attn.view(total, H * D)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return linear(out, self.wo, n_single)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rotate-half RoPE on the leading cos.shape[-1] channels of each head; the rest passes through."""
    rd = cos.shape[-1]
    rot, rest = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    rot = rot * cos + rotated * sin
    return torch.cat((rot, rest), dim=-1) if rest.shape[-1] else rot


def _one_query(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [H, D] against k/v [KVH, L, D] -> [H, D] (two small bmm beat SDPA's per-call cost for one query)."""
    kv_heads, d = k.shape[0], k.shape[2]
    grouped = q.reshape(kv_heads, -1, d) * scale
    scores = torch.bmm(grouped, k.transpose(1, 2)).float()
    return torch.bmm(torch.softmax(scores, dim=-1).to(v.dtype), v).reshape(-1, d)


def _chunk_queries(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """q [n, H, D] (positions start..start+n-1) against k/v [KVH, start + n, D] (views into the slot), causal ->
    [n, H, D]. Each K/V head is used in place by its group of query heads: repeating the keys and values per
    head (and SDPA's scaled copy of the keys) would copy the whole history for a few new tokens, fresh memory
    the kernel faults in on each call (about 12 MiB per layer for 2,048 tokens of a small model)."""
    n, heads, d = q.shape
    kv_heads, length = k.shape[0], k.shape[1]
    groups = heads // kv_heads
    grouped = (q.transpose(0, 1) * scale).reshape(kv_heads, groups * n, d)  # row j * n + i: head kv * groups + j
    scores = torch.bmm(grouped, k.transpose(1, 2)).float()
    future = torch.arange(length, device=q.device) > torch.arange(start, start + n, device=q.device).unsqueeze(1)
    scores.view(kv_heads, groups, n, length).masked_fill_(future, float("-inf"))
    out = torch.bmm(torch.softmax(scores, dim=-1).to(v.dtype), v)  # [KVH, groups * n, D]
    return out.view(heads, n, d).transpose(0, 1)
