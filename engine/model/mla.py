"""Multi-head latent attention (DeepSeek-V3, GLM-4.7-Flash) over the compact latent the K/V store keeps.

Per token and layer the store keeps the latent [c_kv | k_pe] (kv_lora_rank + qk_rope_head_dim values, the
normalised c_kv and the RoPE'd key part shared by every head), its first `store_width` values in the K row and
the rest in the V row of one K/V "head" (mla_config.MlaConfig.store_width). Nothing per head is stored.

Attention absorbs kv_b_proj into the query instead of expanding the latent into per-head keys and values:
a head's score q_nope . (W_uk c_kv) + q_pe . k_pe is (W_uk^T q_nope) . c_kv + q_pe . k_pe, so the query becomes
[W_uk^T q_nope | q_pe] against the stored latent as its one key head, the values are c_kv, and each head's
output is W_uv times its attended c_kv. The same scores as transformers' expansion in another summation order,
and a step reads the latent rows once rather than building keys and values for every earlier token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.model.decoder_layer import DecoderLayer
from engine.model.llama import SeqChunk, rms_norm
from engine.model.mla_config import LATENT_NORM_EPS, MlaConfig, interleaved_to_halves
from engine.model.projections import linear

if TYPE_CHECKING:
    from engine.model.float16 import Float16Weight
    from engine.model.int4 import Int4Weight
    from engine.model.kernels import RowsWeight


class MlaAttention(torch.nn.Module):
    """What a latent-attention layer holds beside the DecoderLayer's fused first projection (`wqkv`: q or q_a,
    then kv_a) and output projection (`wo`): the latent norms, q_b, and kv_b split per head into W_uk and W_uv."""

    q_a_norm: torch.Tensor | None
    q_b: torch.Tensor | None
    kv_a_norm: torch.Tensor
    w_uk: torch.Tensor  # [heads, qk_nope_head_dim, kv_lora_rank]
    w_uv: torch.Tensor  # [heads, v_head_dim, kv_lora_rank]

    def __init__(self, mla: MlaConfig, n_heads: int, *, kv_a_norm: torch.Tensor, kv_b: torch.Tensor,
                 q_a_norm: torch.Tensor | None = None, q_b: torch.Tensor | None = None) -> None:
        super().__init__()
        m, H = mla, n_heads
        assert (q_b is None) == (q_a_norm is None) == (m.q_lora_rank is None), "q_b and its norm go with q_lora_rank"
        if q_b is not None:
            assert q_b.shape == (H * (m.qk_nope_head_dim + m.qk_rope_head_dim), m.q_lora_rank), ("q_b", tuple(q_b.shape))
        assert kv_b.shape == (H * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank), ("kv_b", tuple(kv_b.shape))
        self.mla = mla
        self.n_heads = n_heads
        per_head = kv_b.view(H, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        self.register_buffer("q_a_norm", q_a_norm, persistent=False)
        self.register_buffer("q_b", q_b, persistent=False)
        self.register_buffer("kv_a_norm", kv_a_norm, persistent=False)
        self.register_buffer("w_uk", per_head[:, : m.qk_nope_head_dim].contiguous(), persistent=False)
        self.register_buffer("w_uv", per_head[:, m.qk_nope_head_dim :].contiguous(), persistent=False)

    def query_and_latent(self, layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         n_single: int, fast: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The absorbed query [tokens, heads, latent_width] and the tokens' latents [tokens, latent_width], RoPE
        applied (cos and sin per row in forward_chunks' rolled-sign form, over the RoPE'd width)."""
        h = rms_norm(x, layer.attn_norm, layer.spec.norm.eps)
        return self.project(h, layer.wqkv, cos, sin, n_single, fast, x.dtype)

    def project(self, h: torch.Tensor, wqkv: torch.Tensor | Int4Weight | Float16Weight | RowsWeight,
                cos: torch.Tensor, sin: torch.Tensor, n_single: int, fast: bool,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """query_and_latent of rows `h` already normalised, through the fused first projection `wqkv` (a decoder
        layer's, or a next-token layer's own: engine/model/mtp_attention.py), its products in `dtype`."""
        m, H = self.mla, self.n_heads
        T = h.shape[0]
        first = linear(h, wqkv, n_single, fast=fast).to(dtype)
        q_rows = m.q_rows(H)
        q = first[:, :q_rows]
        if self.q_b is not None:
            assert self.q_a_norm is not None  # set with q_b (__init__)
            q = linear(rms_norm(q, self.q_a_norm, LATENT_NORM_EPS), self.q_b, n_single, fast=fast).to(dtype)
        q = q.view(T, H, m.qk_nope_head_dim + m.qk_rope_head_dim)
        q_nope, q_pe = q[..., : m.qk_nope_head_dim], q[..., m.qk_nope_head_dim :]
        c_kv = rms_norm(first[:, q_rows : q_rows + m.kv_lora_rank], self.kv_a_norm, LATENT_NORM_EPS)
        k_pe = first[:, q_rows + m.kv_lora_rank :].unsqueeze(1)
        half = m.qk_rope_head_dim // 2
        q_pe = q_pe * cos + q_pe.roll(half, -1) * sin  # rotate-half RoPE as one roll (llama.CausalLM.qkv)
        k_pe = k_pe * cos + k_pe.roll(half, -1) * sin
        q_abs = torch.einsum("thn,hnr->thr", q_nope, self.w_uk.to(q_nope.dtype))
        query = torch.cat((q_abs, q_pe.to(q_abs.dtype)), -1)
        latent = torch.cat((c_kv, k_pe[:, 0].to(c_kv.dtype)), -1)
        return query, latent

    def attend(self, layer: DecoderLayer, x: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
               chunks: list[SeqChunk], offsets: list[int], masks: dict[int, torch.Tensor], causal: list[bool],
               cos: torch.Tensor, sin: torch.Tensor, n_single: int, fast: bool) -> torch.Tensor:
        """The attention output [tokens, heads * v_head_dim] of a step's chunks (each against its slot's rows),
        after writing their latents into the slot rows [start, start + n)."""
        query, latent = self.query_and_latent(layer, x, cos, sin, n_single, fast)
        return self.attend_projected(query, latent, kv, chunks, offsets, masks, causal)

    def attend_projected(self, query: torch.Tensor, latent: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
                         chunks: list[SeqChunk], offsets: list[int], masks: dict[int, torch.Tensor],
                         causal: list[bool]) -> torch.Tensor:
        """`attend` from the chunks' absorbed queries and latents (`project`); kv rows as [slots, rows, 1, store]."""
        m, H = self.mla, self.n_heads
        width, store = m.latent_width, m.store_width
        k_rows, v_rows = kv
        padded = latent if 2 * store == width else F.pad(latent, (0, 1))
        out = torch.empty(query.shape[0], H, m.kv_lora_rank, dtype=query.dtype, device=query.device)
        scale = m.softmax_scale
        for i, ch in enumerate(chunks):
            lo, hi = offsets[i], offsets[i + 1]
            end = ch.start + (hi - lo)
            k_rows[ch.slot, ch.start : end, 0] = padded[lo:hi, :store]
            v_rows[ch.slot, ch.start : end, 0] = padded[lo:hi, store:]
            rows = torch.cat((k_rows[ch.slot, :end, 0], v_rows[ch.slot, :end, 0]), -1)[:, :width].to(query.dtype)
            out[lo:hi] = _latent_attention(query[lo:hi], rows, m.kv_lora_rank, masks.get(i), causal[i], scale)
        heads = torch.einsum("thr,hvr->thv", out, self.w_uv.to(out.dtype))
        return heads.reshape(query.shape[0], H * m.v_head_dim)

    def decode_rows(self, layer: DecoderLayer, x: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
                    cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor,
                    length: int, fast: bool) -> torch.Tensor:
        """The captured decode step's attention (graph_decode.decode_step): one token a row, its latent written at
        (slot, pos), rows [0, length) of its slot read, masked past its position (mask [rows, 1, 1, length]);
        no host synchronisation, fixed shapes. Batched products and a float32 softmax as that step's own
        attention, for the same reproducibility. Returns [rows, heads * v_head_dim]."""
        m, H = self.mla, self.n_heads
        width, store, rank = m.latent_width, m.store_width, m.kv_lora_rank
        n = x.shape[0]
        query, latent = self.query_and_latent(layer, x, cos, sin, n, fast)
        padded = latent if 2 * store == width else F.pad(latent, (0, 1))
        k_rows, v_rows = kv
        k_rows.index_put_((slots, pos), padded[:, :store].unsqueeze(1))
        v_rows.index_put_((slots, pos), padded[:, store:].unsqueeze(1))
        rows = torch.cat((k_rows[:, :length, 0].index_select(0, slots), v_rows[:, :length, 0].index_select(0, slots)),
                         -1)[..., :width].to(query.dtype)  # [rows, length, width]
        scores = torch.matmul(query * m.softmax_scale, rows.transpose(1, 2)).float()  # [rows, H, length]
        scores = scores.masked_fill(~mask.view(n, 1, length), float("-inf"))
        attended = torch.matmul(torch.softmax(scores, dim=-1).to(rows.dtype), rows[..., :rank])  # [rows, H, rank]
        heads = torch.einsum("thr,hvr->thv", attended, self.w_uv.to(attended.dtype))
        return heads.reshape(n, H * m.v_head_dim)


def _latent_attention(query: torch.Tensor, rows: torch.Tensor, rank: int, mask: torch.Tensor | None, causal: bool,
                      scale: float) -> torch.Tensor:
    """One chunk's heads [n, H, width] against its slot's latent rows [keys, width] -> [n, H, rank].

    Every head reads the same one latent, so the n x H (position, head) queries are the rows of one query head
    (as llama.cpp runs absorbed MLA: MQA with one K/V head): no per-head copy of the keys (an SDPA over H heads
    of expanded keys can materialise H copies of them), and a row's causal mask is its position's."""
    n, heads, width = query.shape
    q = query.reshape(1, 1, n * heads, width)  # row i * H + h: position i, head h
    keys = rows.view(1, 1, -1, width)
    values = keys[..., :rank]  # c_kv, the latent's first `rank` values
    if mask is not None or (n > 1 and causal):  # a given mask holds for one row too (a context cut short)
        if mask is None:  # from position 0: row i sees keys [0, i]
            mask = torch.arange(rows.shape[0], device=rows.device) <= torch.arange(n, device=rows.device).unsqueeze(1)
        mask = mask.to(rows.device).repeat_interleave(heads, 0)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    return out.view(n, heads, rank)


Getter = Callable[[str, torch.device, torch.dtype], "torch.Tensor | None"]


def rope_rows_in_halves(mla: MlaConfig, n_heads: int, get: Getter) -> tuple[Getter, Callable[[str], bool]]:
    """A getter giving the rows that make RoPE'd channels (each head's last qk_rope_head_dim rows of q / q_b, the
    last of kv_a) in rotate-half order where the file holds them in interleaved pairs (rope_interleave: HF
    DeepSeek-V3 checkpoints and llama.cpp's deepseek2 files alike), and whether a key is one it reorders (the
    file's own quantised blocks of those cannot be used as they are)."""
    rope, head = mla.qk_rope_head_dim, mla.qk_nope_head_dim + mla.qk_rope_head_dim
    order = torch.tensor(interleaved_to_halves(rope))
    q_key = "q_b" if mla.q_lora_rank is not None else "q"

    def reordered(key: str) -> bool:
        return mla.rope_interleave and key.split(".", 1)[-1] in (q_key, "kv_a")

    def halves(key: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
        t = get(key, device, dtype)
        if t is None or not reordered(key):
            return t
        if key.endswith(".kv_a"):
            return torch.cat((t[:-rope], t[-rope:][order.to(t.device)]))
        per_head = t.reshape(n_heads, head, *t.shape[1:])
        rot = per_head[:, head - rope :][:, order.to(t.device)]
        return torch.cat((per_head[:, : head - rope], rot), 1).reshape(t.shape)

    return halves, reordered


def kv_b_joined(get: Getter) -> Getter:
    """A getter that gives a layer's kv_b ([heads x (qk_nope + v), kv_lora_rank], HF's kv_b_proj) from a GGUF's
    attn_k_b and attn_v_b where the file holds it split (mla_config.GGUF_NAMES)."""

    def joined(key: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
        t = get(key, device, dtype)
        if t is not None or not key.endswith(".kv_b"):
            return t
        base = key.removesuffix("kv_b")
        k_b, v_b = get(base + "k_b", device, dtype), get(base + "v_b", device, dtype)
        if k_b is None or v_b is None or k_b.dim() != 3 or v_b.dim() != 3:
            return None  # build_model names the missing kv_b
        return torch.cat((k_b.transpose(1, 2), v_b), 1).reshape(-1, k_b.shape[1])

    return joined
