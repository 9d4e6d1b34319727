"""The attention of a next-token (MTP) layer (mtp_layer.MtpBlock), one class per kind of attention the model's
decoder layers have, so the block itself is one code path:

- `HeadAttention`: per-head K/V (GLM-4.x MoE): fused q/k/v, optional biases and per-head q/k norms, partial
  rotate-half RoPE; K/V rows [rows, kv_heads, head_dim].
- `LatentAttention`: multi-head latent attention (DeepSeek-V3, GLM-4.7-Flash), `mla.MlaAttention` on the layer's
  own latent rows, stored as the model stores its own (the latent's halves in a K and a V row of one
  `store_width` head: [rows, 1, store_width]), so a parked part costs the latent's bytes, not expanded K/V.

- `GatedAttention`: the gated attention of Qwen3-Next and Qwen3.5 (hybrid/attention.py's own projections: query
  rows interleaved per head with a sigmoid output gate, per-head q/k norms, partial RoPE); K/V rows
  [rows, kv_heads, head_dim], its output gated before the block's output projection.

Each writes the rows of positions start .. start+n-1 into caches the caller owns and reads them from `first`
(a context cut short, mtp_drafts.TargetRows.first). Float32 on the CPU, as the block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.errors import ModelLoadError
from engine.model.chunk_attention import rope_rows
from engine.model.hybrid.attention import AttentionMixer
from engine.model.llama import SeqChunk
from engine.model.mla import MlaAttention
from engine.model.norms import head_rms_norm
from engine.model.rope import RotaryTable

if TYPE_CHECKING:
    from engine.model.config import ModelConfig
    from engine.model.hybrid.config import HybridConfig

# A layer's tensor by its canonical key (without the layer's number), checked against the shape expected.
Need = Callable[[str, tuple[int, ...]], torch.Tensor]
CPU = torch.device("cpu")


class HeadAttention:
    """GLM-4.x MoE's attention: per-head keys and values."""

    def __init__(self, c: ModelConfig, need: Need) -> None:
        h, heads, kv_heads, d = c.hidden_size, c.n_heads, c.n_kv_heads, c.head_dim
        self.n_heads, self.eps = heads, c.rms_norm_eps
        self.wqkv = torch.cat((need("q", (heads * d, h)), need("k", (kv_heads * d, h)), need("v", (kv_heads * d, h))))
        self.bqkv = None
        if c.attention_bias:
            self.bqkv = torch.cat((need("q_bias", (heads * d,)), need("k_bias", (kv_heads * d,)),
                                   need("v_bias", (kv_heads * d,))))
        # GLM's q/k norms are per head (one weight of head_dim shared by the heads)
        self.q_norm = need("q_norm", (d,)) if c.qk_norm else None
        self.k_norm = need("k_norm", (d,)) if c.qk_norm else None
        self.rotary = RotaryTable(replace(c, head_dim=c.rotary_dim or d, rotary_dim=None))
        self.kv_shape = (kv_heads, d)
        self.out_width = heads * d  # the output projection's columns

    def __call__(self, h: torch.Tensor, start: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 first: int) -> torch.Tensor:
        """The heads' output [n, out_width] of the normalised rows `h` at positions start .., their K/V written."""
        n, (kv_heads, d), heads = h.shape[0], self.kv_shape, self.n_heads
        qkv = F.linear(h, self.wqkv, self.bqkv)
        q = qkv[:, : heads * d].view(n, heads, d)
        k = qkv[:, heads * d : (heads + kv_heads) * d].view(n, kv_heads, d)
        v = qkv[:, (heads + kv_heads) * d :].view(n, kv_heads, d)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = head_rms_norm(q, self.q_norm, self.eps), head_rms_norm(k, self.k_norm, self.eps)
        cos, sin = self.rotary.get(start + n, CPU, torch.float32)
        cos, sin = cos[start : start + n], sin[start : start + n]
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        k_cache[start : start + n], v_cache[start : start + n] = k, v
        end = start + n
        keys, values = k_cache[first:end].transpose(0, 1), v_cache[first:end].transpose(0, 1)  # [KVH, end-first, D]
        # row i sees positions first .. start+i
        mask = torch.ones(n, end - first, dtype=torch.bool).tril(start - first)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask,
                                             enable_gqa=heads != kv_heads)
        return out.transpose(0, 1).reshape(n, heads * d)


class LatentAttention:
    """Multi-head latent attention over the layer's own latent rows (mla.MlaAttention's absorbed form)."""

    def __init__(self, c: ModelConfig, need: Need, rotary: RotaryTable) -> None:
        m = c.mla
        assert m is not None, "latent attention needs the model's MLA settings"
        hidden, heads = c.hidden_size, c.n_heads
        q_first = ("q" if m.q_lora_rank is None else "q_a", (m.q_rows(heads), hidden))
        self.wqkv = torch.cat((need(*q_first), need("kv_a", (m.latent_width, hidden))))  # as the decoder's wqkv
        q_b = q_a_norm = None
        if m.q_lora_rank is not None:
            q_a_norm = need("q_a_norm", (m.q_lora_rank,))
            q_b = need("q_b", (heads * (m.qk_nope_head_dim + m.qk_rope_head_dim), m.q_lora_rank))
        self.mla = MlaAttention(m, heads, kv_a_norm=need("kv_a_norm", (m.kv_lora_rank,)),
                                kv_b=need("kv_b", (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)),
                                q_a_norm=q_a_norm, q_b=q_b)
        self.rotary = rotary  # the model's own table (YaRN and the file's frequency factors included)
        self.kv_shape = (1, m.store_width)
        self.out_width = heads * m.v_head_dim

    def __call__(self, h: torch.Tensor, start: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 first: int) -> torch.Tensor:
        """The heads' output [n, out_width] of the normalised rows `h` at positions start .., their latents written."""
        n, end = h.shape[0], start + h.shape[0]
        cos, sin = rope_rows(self.rotary, end, torch.arange(start, end), CPU, torch.float32)
        query, latent = self.mla.project(h, self.wqkv, cos, sin, n, False, torch.float32)
        # row i sees positions first .. start+i (the rows before `first` are masked, not read as context)
        keys = torch.arange(end)
        mask = (keys >= first) & (keys <= torch.arange(start, end).unsqueeze(1))
        chunk = SeqChunk(0, start, torch.zeros(n, dtype=torch.int64))
        return self.mla.attend_projected(query, latent, (k_cache[None], v_cache[None]), [chunk], [0, n], {0: mask},
                                         [False])


class GatedAttention:
    """Qwen3-Next / Qwen3.5's gated attention: the decoder's own projections (hybrid AttentionMixer.project), then
    causal attention over the layer's rows from `first`, gated by the query's sigmoid gate."""

    def __init__(self, c: HybridConfig, need: Need, rotary: RotaryTable) -> None:
        h, heads, kv_heads, d = c.hidden_size, c.n_heads, c.n_kv_heads, c.head_dim
        if not (c.attention_gate and c.qk_norm):
            raise ModelLoadError(f"{c.architecture}: a gated next-token attention needs the output gate and q/k norms")
        wqkv = torch.cat((need("q", (2 * heads * d, h)), need("k", (kv_heads * d, h)), need("v", (kv_heads * d, h))))
        self.mixer = AttentionMixer(c, 0, wqkv=wqkv, wo=need("o", (h, heads * d)), q_norm=need("q_norm", (d,)),
                                    k_norm=need("k_norm", (d,)))
        self.rotary = rotary  # the model's own table (partial RoPE: its rotary_dim leading channels)
        self.scale = c.softmax_scale
        self.n_heads = heads
        self.kv_shape = (kv_heads, d)
        self.out_width = heads * d

    def __call__(self, h: torch.Tensor, start: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 first: int) -> torch.Tensor:
        """The gated heads' output [n, out_width] of the normalised rows `h` at positions start .., K/V written."""
        n, end = h.shape[0], start + h.shape[0]
        cos, sin = self.rotary.get(end, CPU, torch.float32)
        q, k, v, gate = self.mixer.project(h, cos[start:end, None], sin[start:end, None], 0)
        assert gate is not None  # checked in __init__
        k_cache[start:end], v_cache[start:end] = k, v
        keys, values = k_cache[first:end].transpose(0, 1), v_cache[first:end].transpose(0, 1)  # [KVH, end-first, D]
        # row i sees positions first .. start+i
        mask = torch.ones(n, end - first, dtype=torch.bool).tril(start - first)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask, scale=self.scale,
                                             enable_gqa=self.n_heads != self.kv_shape[0])
        return out.transpose(0, 1).reshape(n, self.out_width) * torch.sigmoid(gate)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE over a head's leading cos.shape[-1] channels (GLM's partial rotary), the rest as they are."""
    r = cos.shape[-1]
    head, rest = x[..., :r], x[..., r:]
    x1, x2 = head[..., : r // 2], head[..., r // 2 :]
    rotated = head * cos[:, None] + torch.cat((-x2, x1), -1) * sin[:, None]
    return torch.cat((rotated, rest), -1)
