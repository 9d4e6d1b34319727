"""The gated-DeltaNet families from GGUF (llama.cpp's `qwen35`, `qwen35moe` and `qwen3next` architectures): their
metadata keys, tensor names and the rewrites llama.cpp's converter applies, undone so the weights are the Hugging
Face model's.

llama.cpp's converter (Qwen3.5 is a Qwen3-Next text model there) writes:
- every RMSNorm weight outside the DeltaNet as 1 + w (Qwen3.5 stores w and computes with 1 + w);
- `ssm_a` = -exp(A_log), `ssm_dt.bias` = dt_bias, the depthwise conv squeezed to [channels, width];
- with fewer key heads than value heads, the value heads reordered from grouped by key head
  ([k0: v0..v(r-1), k1: ...]) to tiled ([v0 of k0, v0 of k1, ..., v1 of k0, ...]) in every tensor with a value
  head axis: the V rows of `attn_qkv` and of the conv, `attn_gate` (z), `ssm_beta`, `ssm_alpha`, `ssm_a`,
  `ssm_dt`, and the columns of `ssm_out`;
- the layer pattern as `attention.recurrent_layers` (one bool per layer) and `full_attention_interval`, the
  DeltaNet shape as `ssm.*` keys (state_size = key head dim, group_count = key heads, time_step_rank = value heads,
  inner_size = value heads * value head dim), the rotated part of a head as `rope.dimension_count`; multi-token
  prediction layers after the model's own (`nextn_predict_layers`, counted in `block_count`), which are skipped.
Qwen3-Next (`qwen3next`) differs: its value heads stay grouped (no tiling), HF's fused per-key-head `in_proj_qkvz`
is regrouped into `attn_qkv` (q | k | v) and `attn_gate` (z), and `in_proj_ba` stays fused as `ssm_ba` (legacy
files keep qkvz whole as `ssm_in`). The MoE families carry Qwen2-MoE's expert tensors and keys
(engine/model/moe_loading.py); llama.cpp always renormalises their top-k weights and gates the shared expert.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.errors import ModelLoadError
from engine.model.hybrid.config import ATTENTION, DELTA, HybridConfig
from engine.model.moe_config import MoeConfig

LAYER_NAMES = {
    "attn_norm.weight": "mixer_norm", "post_attention_norm.weight": "mlp_norm",
    "attn_q.weight": "q", "attn_k.weight": "k", "attn_v.weight": "v", "attn_output.weight": "o",
    "attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm",
    "attn_qkv.weight": "dn_qkv", "attn_gate.weight": "dn_z", "ssm_beta.weight": "dn_b", "ssm_alpha.weight": "dn_a",
    "ssm_conv1d.weight": "conv", "ssm_dt.bias": "dt_bias", "ssm_a": "neg_a", "ssm_norm.weight": "dn_norm",
    "ssm_out.weight": "dn_out",
    "ffn_gate.weight": "gate", "ffn_up.weight": "up", "ffn_down.weight": "down",
    "ssm_ba.weight": "dn_ba", "ssm_in.weight": "dn_qkvz",  # qwen3next
    "ffn_gate_up_exps.weight": "experts.gate_up",  # the converter's optional fused experts (gate rows, then up)
}
GGUF_ARCHITECTURES = {"qwen35": "qwen3_5", "qwen35moe": "qwen3_5_moe", "qwen3next": "qwen3_next"}
GLOBAL_NAMES = {"token_embd.weight": "embed", "output_norm.weight": "norm", "output.weight": "lm_head"}
# norms llama.cpp stores as 1 + w (the model adds its NORM_OFFSET of 1 again at build)
_SHIFTED_NORMS = ("mixer_norm", "mlp_norm", "q_norm", "k_norm")


def config(meta: dict, tensor_names: set[str], path: str, embed_rows: int) -> HybridConfig:
    arch = meta["general.architecture"]
    assert arch in GGUF_ARCHITECTURES, arch

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"{path}: metadata {arch}.{name} is missing")
        return value

    n_layers = int(key("block_count")) - int(key("nextn_predict_layers", 0))  # MTP layers come last
    recurrent = meta.get(f"{arch}.attention.recurrent_layers")
    if recurrent is not None:
        if len(recurrent) < n_layers:
            raise ModelLoadError(f"{path}: {arch}.attention.recurrent_layers has {len(recurrent)} entries for "
                                 f"{n_layers} layers")
        kinds = tuple(DELTA if recurrent[i] else ATTENTION for i in range(n_layers))
    else:
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
    moe = None if arch == "qwen35" else _moe(meta, arch, tensor_names, n_layers, path)
    return HybridConfig(
        architecture=GGUF_ARCHITECTURES[arch],
        vocab_size=embed_rows,
        hidden_size=hidden,
        intermediate_size=int(meta.get(f"{arch}.feed_forward_length") or (moe.expert_size if moe else
                                                                           key("feed_forward_length"))),
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
        moe=moe,
    )


def _moe(meta: dict, arch: str, tensor_names: set[str], n_layers: int, path: str) -> MoeConfig:
    """The experts as llama.cpp runs them: softmax over the experts, top-k renormalised over the k (its
    build_moe_ffn is called with norm_w true for both families, whatever `expert_weights_norm` says), and the
    shared expert behind its sigmoid gate; a layer without `ffn_gate_inp` has a dense MLP."""
    gating = meta.get(f"{arch}.expert_gating_func")
    if gating not in (None, 1):  # llama.cpp: 1 softmax, 2 sigmoid
        raise ModelLoadError(f"{path}: expert gating function {gating} is not supported (expected 1, softmax)")
    for name in ("expert_count", "expert_used_count", "expert_feed_forward_length"):
        if meta.get(f"{arch}.{name}") is None:
            raise ModelLoadError(f"{path}: metadata {arch}.{name} is missing")
    dense = tuple(i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names)
    shared = meta.get(f"{arch}.expert_shared_feed_forward_length") or meta.get(f"{arch}.feed_forward_length")
    if not shared or any(f"blk.{i}.ffn_gate_inp_shexp.weight" not in tensor_names
                         for i in range(n_layers) if i not in dense):
        raise ModelLoadError(f"{path}: {arch} expert layers need a shared expert (ffn_*_shexp, ffn_gate_inp_shexp "
                             f"and {arch}.expert_shared_feed_forward_length)")
    moe = MoeConfig(n_experts=int(meta[f"{arch}.expert_count"]), top_k=int(meta[f"{arch}.expert_used_count"]),
                    expert_size=int(meta[f"{arch}.expert_feed_forward_length"]), routing="softmax_topk",
                    norm_topk_prob=True, shared_expert_size=int(shared), dense_layers=dense)
    try:
        moe.check(n_layers)
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    return moe


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
    if per_k == 1 or c.architecture == "qwen3_next":  # Qwen3-Next's value heads are not tiled
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
