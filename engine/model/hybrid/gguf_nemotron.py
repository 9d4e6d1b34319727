"""Nemotron-H from GGUF (llama.cpp's `nemotron_h` architecture): its metadata keys and tensor names.

llama.cpp's converter (a Granite-hybrid subclass there) writes the layer pattern as two per-layer arrays: a
layer is attention where `attention.head_count_kv` is non-zero, a feed-forward block where
`feed_forward_length` is non-zero, and Mamba-2 where both are 0. Each block's one norm is `attn_norm`; the
Mamba-2 tensors are rewritten as for Granite-4.0-H (ssm_a = -exp(A_log) and ssm_d as [heads, 1], ssm_norm as
[groups, inner / groups], the conv squeezed, dt_bias as `ssm_dt.bias`) and the q/k rows permuted as for llama
(undone by `engine.model.hybrid.gguf_loader`). dt is not clamped: the file has no key for a dt limit, and
llama.cpp's scan applies none (mamba_ssm's default `dt_limit` (0, inf)).

`nemotron_h_moe` (the MoE models): a feed-forward layer with an `ffn_gate_inp` router runs experts
(`ffn_{up,down}_exps`, the router bias `exp_probs_b`, `ffn_{up,down}_shexp`, the latent projections
`ffn_latent_down` / `ffn_latent_up`; `expert_count`, `expert_used_count`, `expert_feed_forward_length`,
`expert_shared_feed_forward_length`, `expert_weights_norm`, `expert_weights_scale`, `moe_latent_size`,
`expert_group_count` with `expert_group_used_count`: the converter writes no topk_group, so a file with several
expert groups and no `expert_group_used_count` is refused rather than routed another way than the HF model).
"""

from __future__ import annotations

from engine.errors import ModelLoadError
from engine.model.hybrid.config import ATTENTION, MAMBA, MLP, HybridConfig
from engine.model.hybrid.gguf_mamba import mamba_fields, metadata_key
from engine.model.hybrid.nemotron_config import NemotronExperts

ARCHITECTURES = ("nemotron_h", "nemotron_h_moe")

LAYER_NAMES = {
    "attn_norm.weight": "layer_norm",
    "attn_q.weight": "q", "attn_k.weight": "k", "attn_v.weight": "v", "attn_output.weight": "o",
    "ssm_in.weight": "ssm_in", "ssm_conv1d.weight": "conv", "ssm_conv1d.bias": "conv_bias", "ssm_dt.bias": "dt_bias",
    "ssm_a": "neg_a", "ssm_d": "d_skip", "ssm_norm.weight": "ssm_norm", "ssm_out.weight": "ssm_out",
    "ffn_up.weight": "up", "ffn_down.weight": "down",
    "ffn_gate_inp.weight": "router", "exp_probs_b.bias": "score_bias", "ffn_up_exps.weight": "experts.up",
    "ffn_down_exps.weight": "experts.down", "ffn_up_shexp.weight": "shared_up", "ffn_down_shexp.weight": "shared_down",
    "ffn_latent_down.weight": "latent_in", "ffn_latent_up.weight": "latent_out",
}
GLOBAL_NAMES = {"token_embd.weight": "embed", "output_norm.weight": "norm", "output.weight": "lm_head"}
_CHUNK = 128  # and its chunk_size: where the scan cuts its blocks (float rounding only)


def config(meta: dict, tensor_names: set[str], path: str, embed_rows: int) -> HybridConfig:
    arch = meta["general.architecture"]
    assert arch in ARCHITECTURES, arch

    key = metadata_key(meta, arch, path)
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
    moe = tuple(i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" in tensor_names)
    ff = [0 if i in moe else f for i, f in enumerate(ff)]  # a MoE layer's length is one expert's
    for name, values in (("attention.head_count_kv", kv), ("feed_forward_length", ff)):
        if len({v for v in values if v}) > 1:
            raise ModelLoadError(f"{path}: {arch}.{name}: layers of different sizes {sorted(set(values))} are not supported")
    hidden, n_heads = int(key("embedding_length")), int(key("attention.head_count"))
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
        **mamba_fields(key, tensor_names, path),
        mamba_chunk=_CHUNK,
        nemotron_experts=_experts(meta, arch, moe, path) if moe else None,
    )


def _experts(meta: dict, arch: str, layers: tuple[int, ...], path: str) -> NemotronExperts:
    key = metadata_key(meta, arch, path)
    groups = int(key("expert_group_count", 1))
    used_groups = meta.get(f"{arch}.expert_group_used_count")
    if groups > 1 and used_groups is None:
        raise ModelLoadError(f"{path}: {groups} expert groups but no {arch}.expert_group_used_count (transformers' "
                             "topk_group): the routing is ambiguous")
    settings = NemotronExperts(
        layers=layers, n_experts=int(key("expert_count")), top_k=int(key("expert_used_count")),
        expert_size=int(key("expert_feed_forward_length")), shared_size=int(key("expert_shared_feed_forward_length")),
        n_group=groups, topk_group=int(used_groups or 1), norm_topk_prob=bool(key("expert_weights_norm", False)),
        scaling=float(key("expert_weights_scale", 1.0)), latent_size=int(key("moe_latent_size", 0)),
    )
    try:
        settings.check()
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    return settings
