"""Qwen3-Next: Qwen3.5's layers (gated DeltaNet + gated attention, partial RoPE, every RMSNorm outside the
DeltaNet stored as w - 1) with Qwen2-MoE's sparse MLP.

What differs from Qwen3.5 (transformers' modeling_qwen3_next against modeling_qwen3_5):
- the DeltaNet's input projections are two fused matrices laid out per key head: `in_proj_qkvz` holds, for each
  key head g, [q_g, k_g, v_g (its value heads), z_g] and `in_proj_ba` [b_g, a_g]; they are regrouped at load into
  Qwen3.5's q | k | v | z | b | a (value heads still grouped by key head, as the DeltaNet expects);
- the MLP is an expert block on layers (i + 1) % decoder_sparse_step == 0 not in mlp_only_layers (a dense MLP of
  intermediate_size elsewhere, and everywhere when num_experts is 0): softmax over the experts, top-k,
  renormalised over the k when norm_topk_prob, plus a shared expert behind a sigmoid gate (one more router row).
The attention (q_proj rows interleaved per head with the output gate, q/k norms over head_dim) and the gated
norm are Qwen3.5's. GGUF (llama.cpp's `qwen3next`): engine/model/hybrid/gguf_qwen35.py.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.model.hybrid import qwen3_5
from engine.model.hybrid.config import ConfigError, HybridConfig
from engine.model.moe_config import moe_from_hf

NORM_OFFSET = 1.0


def config_from_hf(cfg: dict[str, Any]) -> HybridConfig:
    moe = None
    if int(cfg.get("num_experts", 512)) > 0:
        try:
            # Qwen2-MoE's rules (sparse step, mlp-only layers, the gated shared expert); Qwen3-Next's class
            # renormalises the top-k weights unless told not to.
            moe = moe_from_hf("qwen2_moe", {**cfg, "norm_topk_prob": cfg.get("norm_topk_prob", True)})
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return qwen3_5.text_config(cfg, "qwen3_next", int(cfg.get("intermediate_size", 5632)), moe)


HF_LAYER_NAMES = {
    **{k: v for k, v in qwen3_5.HF_LAYER_NAMES.items() if not k.startswith("linear_attn.in_proj")},
    "linear_attn.in_proj_qkvz.weight": "dn_qkvz", "linear_attn.in_proj_ba.weight": "dn_ba",
}
HF_GLOBAL_NAMES = qwen3_5.HF_GLOBAL_NAMES


def build_mixer(config: HybridConfig, layer: int, need, opt, to) -> torch.nn.Module:
    """The DeltaNet from HF's fused per-key-head projections, or from GGUF's attn_qkv / attn_gate (llama.cpp's
    converter regroups qkvz the same way) with the fused `ssm_ba`."""
    c, p = config, f"{layer}."
    d, nk, dk, dv = c.hidden_size, c.linear_k_heads, c.linear_k_dim, c.linear_v_dim
    per_k = c.linear_v_heads // nk
    group = 2 * dk + 2 * per_k * dv
    qkvz = opt(p + "dn_qkvz", (nk * group, d))
    if qkvz is not None:
        q, k, v, z = qkvz.reshape(nk, group, d).split([dk, dk, per_k * dv, per_k * dv], dim=1)
        qkv, z = torch.cat([t.reshape(-1, d) for t in (q, k, v)]), z.reshape(-1, d)
    else:
        qkv, z = need(p + "dn_qkv", (c.conv_channels, d)), need(p + "dn_z", (c.linear_v_heads * dv, d))
    b, a = need(p + "dn_ba", (2 * c.linear_v_heads, d)).reshape(nk, 2 * per_k, d).split([per_k, per_k], dim=1)
    w_in = torch.cat((qkv, z, b.reshape(-1, d), a.reshape(-1, d)))
    return qwen3_5.deltanet_mixer(c, layer, w_in, need, to)
