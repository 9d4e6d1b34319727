"""GLM-4.x MoE's next-token (MTP) layer, runnable: built from the tensors the loaders keep (`CausalLM.mtp`, mtp.py).

For the row of position t it takes the target's hidden state at t (after the final norm: the row its logits are
taken from) and the token at t+1, and predicts the token at t+2:

    x = eh_proj([enorm(embed(token_{t+1})); hnorm(hidden_t)])
    x = decoder_layer(x)            # attention over its own K/V of the earlier rows (RoPE at position t), then MoE
    logits = head(shared_head.norm(x))

as llama.cpp's glm4-moe nextn graph computes it (its `t_h_nextn`: the target's rows after `output_norm`, the
layer's own after `shared_head.norm`). The embedding and the head are the MTP layer's own where the file holds
them (`nextn.embed_tokens`, `nextn.shared_head_head`), else the model's. The layer's output row after
`shared_head.norm` is the hidden state its next step takes in place of the target's (drafting further ahead).

The weights become float32 on the CPU (a GGUF tensor dequantised): the draft runs one row per step, and the
layer is a single MoE layer, small beside the model.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.errors import ModelLoadError
from engine.model import gguf_dequant, moe_loading
from engine.model.norms import head_rms_norm, rms_norm
from engine.model.projections import logit_rows
from engine.model.quant_embedding import embed_rows
from engine.model.rope import RotaryTable

if TYPE_CHECKING:
    from engine.model.config import ModelConfig
    from engine.model.llama import CausalLM
    from engine.model.mtp import KeptTensor, MtpLayer


def float_weight(t: KeptTensor) -> torch.Tensor:
    """A kept tensor as float32 on the CPU (a GGUF one decoded from its own bytes)."""
    if t.kind.startswith("torch."):
        return t.data.to(torch.float32)
    from gguf import GGMLQuantizationType

    return gguf_dequant.dequantize(t.name, t.data, int(GGMLQuantizationType[t.kind]), t.shape)


class MtpBlock:
    """One next-token layer, float32 on the CPU; its K/V rows live in caches the caller owns ([rows, KVH, D])."""

    def __init__(self, model: CausalLM, layer: MtpLayer, index: int = 0) -> None:
        c = model.config
        if c.architecture != "glm4_moe" or c.mla is not None:
            raise ModelLoadError(f"next-token layers run for GLM-4.x MoE only, not {c.architecture}")
        self.config: ModelConfig = c
        self.index = c.n_layers + index  # the layer's number in the file (its MoE keys)
        self.eps = c.rms_norm_eps
        weights = {key: float_weight(t) for key, t in layer.items()}
        h, heads, kv_heads, d = c.hidden_size, c.n_heads, c.n_kv_heads, c.head_dim
        where = f"next-token layer {self.index}"

        def need(key: str, shape: tuple[int, ...]) -> torch.Tensor:
            t = weights.get(key)
            if t is None:
                raise ModelLoadError(f"{where}: the tensor {key} is missing")
            if tuple(t.shape) != shape:
                raise ModelLoadError(f"{where}: {key} has shape {tuple(t.shape)}, expected {shape}")
            return t

        self.eh_proj = need("nextn.eh_proj", (h, 2 * h))
        self.enorm, self.hnorm = need("nextn.enorm", (h,)), need("nextn.hnorm", (h,))
        self.head_norm = need("nextn.shared_head_norm", (h,))
        self.attn_norm, self.mlp_norm = need("attn_norm", (h,)), need("mlp_norm", (h,))
        self.wqkv = torch.cat((need("q", (heads * d, h)), need("k", (kv_heads * d, h)), need("v", (kv_heads * d, h))))
        self.bqkv = None
        if c.attention_bias:
            self.bqkv = torch.cat((need("q_bias", (heads * d,)), need("k_bias", (kv_heads * d,)),
                                   need("v_bias", (kv_heads * d,))))
        self.wo = need("o", (h, heads * d))
        # GLM's q/k norms are per head (one weight of head_dim shared by the heads)
        self.q_norm = need("q_norm", (d,)) if c.qk_norm else None
        self.k_norm = need("k_norm", (d,)) if c.qk_norm else None
        if not c.is_moe_layer(self.index):
            raise ModelLoadError(f"{where}: expected a MoE layer (first_k_dense_replace covers it)")
        prefixed = {f"{self.index}.{key}": t for key, t in weights.items()}

        def moe_need(key: str, shape: tuple[int, ...]) -> torch.Tensor:
            return need(key.split(".", 1)[1], shape)

        self.moe = moe_loading.build_sparse_moe(c, self.index, prefixed.get, moe_need, lambda t: t, where)
        # The MTP layer's own embedding and head where the file holds them, else the model's (as llama.cpp).
        self.embed = weights.get("nextn.embed_tokens")
        self.model_embed, self.embed_scale = model.embed, model.embed_scale
        self.head = weights.get("nextn.shared_head_head")
        self.model_head = model.lm_head
        rotated = c.rotary_dim or d
        self.rotary = RotaryTable(replace(c, head_dim=rotated, rotary_dim=None))
        self.kv_shape = (kv_heads, d)

    def new_cache(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Empty K and V rows for one sequence of up to `rows` positions."""
        return (torch.zeros(rows, *self.kv_shape), torch.zeros(rows, *self.kv_shape))

    @torch.no_grad()
    def forward(self, next_ids: torch.Tensor, hidden: torch.Tensor, start: int,
                cache: tuple[torch.Tensor, torch.Tensor], first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [n, vocab] (float32) for the tokens at start+2 .. start+n+1, and the layer's output rows [n, h]
        after `shared_head.norm` (what a next step takes as its hidden rows),
        from `next_ids` (the tokens at start+1 ..) and `hidden` (the target's, or this layer's, rows at start ..).
        Writes the K/V rows of positions start .. start+n-1 into `cache` and attends to its rows from `first`
        before them (a later `first`: a context cut short, for rows whose earlier hidden rows are not at hand)."""
        n = next_ids.shape[0]
        assert hidden.shape == (n, self.config.hidden_size), ("hidden", tuple(hidden.shape))
        k_cache, v_cache = cache
        if start + n > k_cache.shape[0]:
            raise ValueError(f"next-token layer: positions up to {start + n} do not fit its {k_cache.shape[0]} rows")
        table = self.embed if self.embed is not None else self.model_embed
        e = embed_rows(next_ids.to(self.model_embed.device), table, self.embed_scale).to("cpu", torch.float32)
        x = F.linear(torch.cat((rms_norm(e, self.enorm, self.eps),
                                rms_norm(hidden.to("cpu", torch.float32), self.hnorm, self.eps)), -1), self.eh_proj)
        assert 0 <= first <= start, (first, start)
        x = x + F.linear(self._attention(rms_norm(x, self.attn_norm, self.eps), start, k_cache, v_cache, first),
                         self.wo)
        x = x + self.moe(rms_norm(x, self.mlp_norm, self.eps), 0)
        h = rms_norm(x, self.head_norm, self.eps)
        if self.head is not None:
            return F.linear(h, self.head), h
        head = self.model_head
        return logit_rows(h.to(self.model_embed.device, self.model_embed.dtype), head).float().cpu(), h

    def _attention(self, h: torch.Tensor, start: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   first: int) -> torch.Tensor:
        c = self.config
        n, (kv_heads, d), heads = h.shape[0], self.kv_shape, c.n_heads
        qkv = F.linear(h, self.wqkv, self.bqkv)
        q = qkv[:, : heads * d].view(n, heads, d)
        k = qkv[:, heads * d : (heads + kv_heads) * d].view(n, kv_heads, d)
        v = qkv[:, (heads + kv_heads) * d :].view(n, kv_heads, d)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = head_rms_norm(q, self.q_norm, self.eps), head_rms_norm(k, self.k_norm, self.eps)
        cos, sin = self.rotary.get(start + n, torch.device("cpu"), torch.float32)
        q, k = _rope(q, cos[start : start + n], sin[start : start + n]), _rope(k, cos[start : start + n], sin[start : start + n])
        k_cache[start : start + n], v_cache[start : start + n] = k, v
        end = start + n
        keys, values = k_cache[first:end].transpose(0, 1), v_cache[first:end].transpose(0, 1)  # [KVH, end-first, D]
        # row i sees positions first .. start+i
        mask = torch.ones(n, end - first, dtype=torch.bool).tril(start - first)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask,
                                             enable_gqa=heads != kv_heads)
        return out.transpose(0, 1).reshape(n, heads * d)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE over a head's leading cos.shape[-1] channels (GLM's partial rotary), the rest as they are."""
    r = cos.shape[-1]
    head, rest = x[..., :r], x[..., r:]
    x1, x2 = head[..., : r // 2], head[..., r // 2 :]
    rotated = head * cos[:, None] + torch.cat((-x2, x1), -1) * sin[:, None]
    return torch.cat((rotated, rest), -1)
