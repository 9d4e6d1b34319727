"""What Gemma 4 (text) adds to Gemma 3's description: its config.json settings, the variants refused, and the
proportional RoPE of its global layers.

Over Gemma 3 the layer has: norms that scale by w (not 1 + w), an RMSNorm without a weight on each value head,
an attention scale of 1 (the q/k norms set the scores' range), a per-layer scalar on the layer's output, and
per-layer input embeddings (PLE: a second, narrow embedding of the token and a projection of the main one,
fed to every layer through a gated residual; engine/model/per_layer_inputs.py). The global layers may take
their values from the key projection (`attention_k_eq_v`: the loaders stack k's rows where v's would be) and
rotate only the leading `partial_rotary_factor` of each half of a head ("proportional" RoPE: the other
frequencies are 0, written as divisors of infinity, as llama.cpp's converter writes them as 1e30).

The global layers may have their own head width and K/V head count (`global_head_dim`, with `attention_k_eq_v`
`num_global_key_value_heads`); the slots hold one row shape wide enough for every layer (ModelConfig.kv_row).

The last `num_kv_shared_layers` layers may read an earlier layer's K/V instead of computing their own (the slots
and the cache then hold fewer layers, ModelConfig.kv_layers), with an MLP twice as wide (`use_double_wide_mlp`).

Every layer may have an expert block beside its dense MLP (`enable_moe_block`, GGUF `expert_count`;
gemma4_experts.py). Refused at load, with the setting named: bidirectional attention.
"""

from __future__ import annotations

from typing import Any

import torch

_HF_LOCAL_ROPE_BASE = 10000.0
_HF_GLOBAL_HEAD_DIM = 512  # Gemma4TextConfig's global_head_dim when config.json names none
_HF_PARTIAL_ROTARY = 0.25  # the full layers' default `partial_rotary_factor`


def _global_shape(cfg: dict[str, Any]) -> tuple[int, int]:
    """(head width, K/V heads) of the global layers as Gemma4TextConfig resolves them: `global_head_dim` (512
    unless given, or a `per_layer_config` entry's), and with `attention_k_eq_v` `num_global_key_value_heads`."""
    head_dim, kv_heads = int(cfg.get("head_dim") or 256), int(cfg.get("num_key_value_heads") or 1)
    per_layer = cfg.get("per_layer_config")
    entry: dict[str, Any] = {}
    if isinstance(per_layer, dict):  # transformers saves an override for each global layer (the same for all)
        types = cfg.get("layer_types")
        keys = [str(i) for i, t in enumerate(types) if t == "full_attention"] if types else list(per_layer)
        entry = next((per_layer[k] for k in keys if isinstance(per_layer.get(k), dict)), {})
    if "global_head_dim" in cfg:
        global_dim = int(cfg["global_head_dim"])
    elif "head_dim" in entry:
        global_dim = int(entry["head_dim"])
    else:  # a saved per_layer_config (even empty) is what transformers resolved: no override means head_dim
        global_dim = head_dim if isinstance(per_layer, dict) else _HF_GLOBAL_HEAD_DIM
    global_kv = kv_heads
    if cfg.get("attention_k_eq_v"):
        global_kv = int(cfg.get("num_global_key_value_heads") or entry.get("num_key_value_heads") or kv_heads)
    return global_dim, global_kv


def hf_gemma4_problem(cfg: dict[str, Any]) -> str | None:
    """What in a gemma4_text config.json names a variant this engine does not run (the setting named), or None."""
    act = cfg.get("hidden_activation") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        return f"gemma4: hidden_activation {act!r} is not supported (expected gelu_pytorch_tanh)"
    if cfg.get("use_bidirectional_attention"):
        return "gemma4: use_bidirectional_attention is not supported (a causal model is expected)"
    rope = cfg.get("rope_parameters") or {}
    for kind, allowed in (("full_attention", ("default", "proportional")), ("sliding_attention", ("default",))):
        rope_type = (rope.get(kind) or {}).get("rope_type", "default")
        if rope_type not in allowed:
            return f"gemma4: rope_parameters.{kind}.rope_type {rope_type!r} is not supported (expected {allowed})"
    return None


def hf_gemma4_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields of a gemma4_text config.json beyond the Llama family's."""
    rope = cfg.get("rope_parameters") or {}
    full = rope.get("full_attention") or {"rope_type": "proportional"}
    local = rope.get("sliding_attention") or {}
    head_dim, kv_heads = int(cfg.get("head_dim") or 256), int(cfg.get("num_key_value_heads") or 1)
    global_dim, global_kv = _global_shape(cfg)
    pairs = None
    if full.get("rope_type") == "proportional":  # of the global layers' own width
        factor = full.get("partial_rotary_factor", _HF_PARTIAL_ROTARY)
        if not isinstance(factor, (int, float)) or not 0 < factor <= 1:
            raise ValueError(f"partial_rotary_factor: expected a number in (0, 1], got {factor!r}")
        pairs = int(factor * global_dim // 2)
        pairs = None if pairs == global_dim // 2 else pairs
    ple = int(cfg.get("hidden_size_per_layer_input") or 0)
    return {
        "rope_local_theta": float(local.get("rope_theta", _HF_LOCAL_ROPE_BASE)),
        "query_pre_attn_scalar": 1.0,  # Gemma 4 scales scores by 1: the q/k norms bound them
        "per_layer_input": ple,
        "per_layer_vocab": int(cfg.get("vocab_size_per_layer_input") or cfg["vocab_size"]) if ple else 0,
        "attention_k_eq_v": bool(cfg.get("attention_k_eq_v")),
        "rope_pairs": pairs,
        "global_head_dim": global_dim if global_dim != head_dim else None,
        "global_kv_heads": global_kv if global_kv != kv_heads else None,
        "kv_shared_layers": int(cfg.get("num_kv_shared_layers") or 0),
        "double_wide_mlp": bool(cfg.get("use_double_wide_mlp")) and bool(cfg.get("num_kv_shared_layers")),
        "parallel_experts": ((int(cfg.get("num_experts") or 0), int(cfg.get("top_k_experts") or 0),
                              int(cfg.get("moe_intermediate_size") or 0)) if cfg.get("enable_moe_block") else (0, 0, 0)),
    }


def proportional_factors(head_dim: int, pairs: int) -> torch.Tensor:
    """RoPE frequency divisors [head_dim / 2] of proportional RoPE: 1 for the first `pairs` frequencies (those of
    the whole head width), infinity (a frequency of 0: those channels pass unrotated) for the rest."""
    assert 0 < pairs < head_dim // 2, (pairs, head_dim)
    return torch.cat((torch.ones(pairs), torch.full((head_dim // 2 - pairs,), float("inf"))))


def gguf_gemma4_fields(arch: str, meta: dict[str, Any], tensor_names: set[str], n_layers: int,
                       vocab: int) -> dict[str, Any]:
    """The ModelConfig fields of a gemma4 GGUF (llama.cpp's converter) beyond the Llama family's ({} for other
    architectures); ValueError for a setting this engine does not run. The global layers' proportional RoPE is
    the file's `rope_freqs` tensor; attention_k_eq_v is a global layer without `attn_v`."""
    if arch != "gemma4":
        return {}
    shared = int(meta.get(f"{arch}.attention.shared_kv_layers") or 0)
    ff = meta.get(f"{arch}.feed_forward_length")
    double = isinstance(ff, list) and shared > 0 and ff == [ff[0]] * (n_layers - shared) + [2 * ff[0]] * shared
    if isinstance(ff, list) and len(set(ff)) > 1 and not double:
        raise ValueError(f"{arch}.feed_forward_length differs between layers ({sorted(set(ff))}) other than twice as "
                         "wide on the K/V-sharing layers: not supported")
    full_k, full_v = meta.get(f"{arch}.attention.key_length"), meta.get(f"{arch}.attention.value_length")
    swa_k = meta.get(f"{arch}.attention.key_length_swa") or full_k
    swa_v = meta.get(f"{arch}.attention.value_length_swa") or full_v
    if full_k != full_v or swa_k != swa_v:
        raise ValueError(f"{arch}: key and value widths differ ({full_k}, {full_v}; sliding {swa_k}, {swa_v})")
    rotated = meta.get(f"{arch}.rope.dimension_count_swa")
    if rotated is not None and swa_k is not None and int(rotated) != int(swa_k):
        raise ValueError(f"{arch}.rope.dimension_count_swa {rotated}: partial RoPE on the sliding layers is not "
                         f"supported (expected the head width, {swa_k})")
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    full = [i for i in range(n_layers) if not (isinstance(pattern, list) and i < len(pattern) and pattern[i])]
    sliding = [i for i in range(n_layers) if i not in full]
    kv = meta.get(f"{arch}.attention.head_count_kv")
    kv_of = (lambda i: int(kv[i])) if isinstance(kv, list) else (lambda i: int(kv or 0))
    for group in (full, sliding):
        if isinstance(kv, list) and len({kv_of(i) for i in group}) > 1:
            raise ValueError(f"{arch}.attention.head_count_kv differs within the global or the sliding layers ({kv})")
    ple = int(meta.get(f"{arch}.embedding_length_per_layer_input") or 0)
    cap = meta.get(f"{arch}.final_logit_softcapping")
    return {
        "rope_local_theta": float(meta.get(f"{arch}.rope.freq_base_swa") or _HF_LOCAL_ROPE_BASE),
        "query_pre_attn_scalar": 1.0,
        "final_logit_softcapping": float(cap) if cap else None,
        "per_layer_input": ple,
        "per_layer_vocab": vocab if ple else 0,  # llama.cpp reads the per-layer table with n_vocab rows too
        "attention_k_eq_v": any(f"blk.{i}.attn_v.weight" not in tensor_names for i in full),
        # The sliding layers' shape is the model's (gguf_loading reads key_length_swa and head_count_kv there).
        "head_dim": int(swa_k) if swa_k else None,
        "n_kv_heads": kv_of(sliding[0]) if sliding and kv else None,
        "global_head_dim": int(full_k) if full_k and full_k != swa_k else None,
        "global_kv_heads": kv_of(full[0]) if full and sliding and kv and kv_of(full[0]) != kv_of(sliding[0]) else None,
        "kv_shared_layers": shared,
        "double_wide_mlp": double,
        "parallel_experts": (int(meta.get(f"{arch}.expert_count") or 0), int(meta.get(f"{arch}.expert_used_count") or 0),
                             int(meta.get(f"{arch}.expert_feed_forward_length") or 0)),
    }
