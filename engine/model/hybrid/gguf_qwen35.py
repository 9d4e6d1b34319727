"""Qwen3.5 from GGUF (llama.cpp's `qwen35` architecture): its metadata keys, tensor names and the rewrites its
converter applies, undone so the weights are the Hugging Face model's.

llama.cpp's converter (Qwen3.5 is a Qwen3-Next text model there) writes:
- every RMSNorm weight outside the DeltaNet as 1 + w (Qwen3.5 stores w and computes with 1 + w);
- `ssm_a` = -exp(A_log), `ssm_dt.bias` = dt_bias, the depthwise conv squeezed to [channels, width];
- with fewer key heads than value heads, the value heads reordered from grouped by key head
  ([k0: v0..v(r-1), k1: ...]) to tiled ([v0 of k0, v0 of k1, ..., v1 of k0, ...]) in every tensor with a value
  head axis: the V rows of `attn_qkv` and of the conv, `attn_gate` (z), `ssm_beta`, `ssm_alpha`, `ssm_a`,
  `ssm_dt`, and the columns of `ssm_out`;
- the layer pattern as `full_attention_interval`, the DeltaNet shape as `ssm.*` keys (state_size = key head dim,
  group_count = key heads, time_step_rank = value heads, inner_size = value heads * value head dim), the rotated
  part of a head as `rope.dimension_count`.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.errors import ModelLoadError
from engine.model.hybrid.config import ATTENTION, DELTA, HybridConfig

LAYER_NAMES = {
    "attn_norm.weight": "mixer_norm", "post_attention_norm.weight": "mlp_norm",
    "attn_q.weight": "q", "attn_k.weight": "k", "attn_v.weight": "v", "attn_output.weight": "o",
    "attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm",
    "attn_qkv.weight": "dn_qkv", "attn_gate.weight": "dn_z", "ssm_beta.weight": "dn_b", "ssm_alpha.weight": "dn_a",
    "ssm_conv1d.weight": "conv", "ssm_dt.bias": "dt_bias", "ssm_a": "neg_a", "ssm_norm.weight": "dn_norm",
    "ssm_out.weight": "dn_out",
    "ffn_gate.weight": "gate", "ffn_up.weight": "up", "ffn_down.weight": "down",
}
GLOBAL_NAMES = {"token_embd.weight": "embed", "output_norm.weight": "norm", "output.weight": "lm_head"}
# norms llama.cpp stores as 1 + w (the model adds its NORM_OFFSET of 1 again at build)
_SHIFTED_NORMS = ("mixer_norm", "mlp_norm", "q_norm", "k_norm")


def config(meta: dict, tensor_names: set[str], path: str, embed_rows: int) -> HybridConfig:
    arch = "qwen35"

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"{path}: metadata {arch}.{name} is missing")
        return value

    n_layers = int(key("block_count"))
    interval = int(key("full_attention_interval", 4))
    if interval < 1:
        raise ModelLoadError(f"{path}: {arch}.full_attention_interval must be >= 1, got {interval}")
    kinds = tuple(ATTENTION if (i + 1) % interval == 0 else DELTA for i in range(n_layers))
    kv = key("attention.head_count_kv")
    if isinstance(kv, list):
        attn_kv = sorted({int(v) for v in kv if int(v)})
        if len(attn_kv) != 1:
            raise ModelLoadError(f"{path}: attention layers with K/V head counts {attn_kv} are not supported")
        kv = attn_kv[0]
    hidden, n_heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // n_heads)
    k_heads, v_heads = int(key("ssm.group_count")), int(key("ssm.time_step_rank"))
    if v_heads % k_heads:
        raise ModelLoadError(f"{path}: {v_heads} value heads are not a multiple of {k_heads} key heads")
    return HybridConfig(
        architecture="qwen3_5",
        vocab_size=embed_rows,
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        layer_kinds=kinds,
        n_heads=n_heads,
        n_kv_heads=int(kv),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(key("context_length", 32768)),
        tie_word_embeddings="output.weight" not in tensor_names,
        rope_theta=float(key("rope.freq_base", 10000000.0)),
        rotary_dim=int(key("rope.dimension_count", head_dim // 4)) // 2 * 2,
        attention_gate=True,
        qk_norm=True,
        conv_kernel=int(key("ssm.conv_kernel")),
        linear_k_heads=k_heads,
        linear_v_heads=v_heads,
        linear_k_dim=int(key("ssm.state_size")),
        linear_v_dim=int(key("ssm.inner_size")) // v_heads,
    )


def untile_v_heads(t: torch.Tensor, dim: int, k_heads: int, per_k: int, head_dim: int) -> torch.Tensor:
    """Value heads along `dim` from llama.cpp's tiled order back to grouped by key head (HF's order)."""
    shape = list(t.shape)
    dim = dim % len(shape)
    split = shape[:dim] + [per_k, k_heads, head_dim] + shape[dim + 1:]
    return t.reshape(split).transpose(dim, dim + 1).reshape(shape).contiguous()


def fix(c: HybridConfig, key: str, w: torch.Tensor) -> torch.Tensor:
    """A tensor as read from the file -> the HF model's (the canonical `key` names what it is)."""
    name = key.rsplit(".", 1)[-1]
    if name in _SHIFTED_NORMS or key == "norm":
        return w - 1.0
    k, per_k = c.linear_k_heads, c.linear_v_heads // c.linear_k_heads
    if per_k == 1:
        return w
    vd = c.linear_v_dim
    if name == "dn_qkv":
        qk = 2 * k * c.linear_k_dim
        return torch.cat((w[:qk], untile_v_heads(w[qk:], 0, k, per_k, vd)))
    if name == "conv":  # [channels, 1, width]: the V channels come after q and k
        qk = 2 * k * c.linear_k_dim
        return torch.cat((w[:qk], untile_v_heads(w[qk:], 0, k, per_k, vd)))
    if name == "dn_z":
        return untile_v_heads(w, 0, k, per_k, vd)
    if name in ("dn_b", "dn_a", "dt_bias", "neg_a"):
        return untile_v_heads(w, 0, k, per_k, 1)
    if name == "dn_out":
        return untile_v_heads(w, 1, k, per_k, vd)
    return w
