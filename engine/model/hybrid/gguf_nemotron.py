"""Nemotron-H from GGUF (llama.cpp's `nemotron_h` architecture): its metadata keys and tensor names.

llama.cpp's converter (a Granite-hybrid subclass there) writes the layer pattern as two per-layer arrays: a
layer is attention where `attention.head_count_kv` is non-zero, a feed-forward block where
`feed_forward_length` is non-zero, and Mamba-2 where both are 0. Each block's one norm is `attn_norm`; the
Mamba-2 tensors are rewritten as for Granite-4.0-H (ssm_a = -exp(A_log) and ssm_d as [heads, 1], ssm_norm as
[groups, inner / groups], the conv squeezed, dt_bias as `ssm_dt.bias`) and the q/k rows permuted as for llama
(undone by `engine.model.hybrid.gguf_loader`). The file has no key for transformers' `time_step_min`, so its
default (0.001) clamps dt as the HF model does. `nemotron_h_moe` files (the MoE models) are refused.
"""

from __future__ import annotations

from typing import Any

from engine.errors import ModelLoadError
from engine.model.hybrid.config import ATTENTION, MAMBA, MLP, HybridConfig

LAYER_NAMES = {
    "attn_norm.weight": "layer_norm",
    "attn_q.weight": "q", "attn_k.weight": "k", "attn_v.weight": "v", "attn_output.weight": "o",
    "ssm_in.weight": "ssm_in", "ssm_conv1d.weight": "conv", "ssm_conv1d.bias": "conv_bias", "ssm_dt.bias": "dt_bias",
    "ssm_a": "neg_a", "ssm_d": "d_skip", "ssm_norm.weight": "ssm_norm", "ssm_out.weight": "ssm_out",
    "ffn_up.weight": "up", "ffn_down.weight": "down",
}
GLOBAL_NAMES = {"token_embd.weight": "embed", "output_norm.weight": "norm", "output.weight": "lm_head"}
_DT_MIN = 0.001  # transformers' NemotronHConfig.time_step_min default
_CHUNK = 128  # and its chunk_size: where the scan cuts its blocks (float rounding only)


def config(meta: dict, tensor_names: set[str], path: str, embed_rows: int) -> HybridConfig:
    arch = "nemotron_h"

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"{path}: metadata {arch}.{name} is missing")
        return value

    n_layers = int(key("block_count"))

    def per_layer(name: str) -> list[int]:
        value = key(name)
        values = [int(v) for v in value] if isinstance(value, list) else [int(value)] * n_layers
        if len(values) != n_layers:
            raise ModelLoadError(f"{path}: {arch}.{name} has {len(values)} entries for {n_layers} layers")
        return values

    kv, ff = per_layer("attention.head_count_kv"), per_layer("feed_forward_length")
    if any(k and f for k, f in zip(kv, ff, strict=True)):
        raise ModelLoadError(f"{path}: a layer has both attention heads and a feed-forward length (one block each)")
    kinds = tuple(ATTENTION if k else MLP if f else MAMBA for k, f in zip(kv, ff, strict=True))
    for name, values in (("attention.head_count_kv", kv), ("feed_forward_length", ff)):
        if len({v for v in values if v}) > 1:
            raise ModelLoadError(f"{path}: {arch}.{name}: layers of different sizes {sorted(set(values))} are not supported")
    hidden, n_heads = int(key("embedding_length")), int(key("attention.head_count"))
    heads, inner = int(key("ssm.time_step_rank")), int(key("ssm.inner_size"))
    if inner % heads:
        raise ModelLoadError(f"{path}: {arch}.ssm.inner_size {inner} is not a multiple of the {heads} heads")
    eps = meta.get(f"{arch}.attention.layer_norm_rms_epsilon", meta.get(f"{arch}.attention.layer_norm_epsilon", 1e-5))
    return HybridConfig(
        architecture="nemotron_h",
        vocab_size=embed_rows,
        hidden_size=hidden,
        intermediate_size=max(ff) or 1,  # a model with no MLP block keeps a neutral positive size
        layer_kinds=kinds,
        n_heads=n_heads,
        n_kv_heads=max(kv) or n_heads,
        head_dim=int(meta.get(f"{arch}.attention.key_length") or hidden // n_heads),
        rms_norm_eps=float(eps),
        max_position_embeddings=int(key("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        conv_kernel=int(key("ssm.conv_kernel")),
        conv_bias=any(n.endswith(".ssm_conv1d.bias") for n in tensor_names),
        mamba_heads=heads,
        mamba_head_dim=inner // heads,
        mamba_groups=int(key("ssm.group_count")),
        mamba_state_dim=int(key("ssm.state_size")),
        mamba_chunk=_CHUNK,
        mamba_dt_min=_DT_MIN,
    )
