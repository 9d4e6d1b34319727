"""Granite-4.0-H (`granitemoehybrid`): Mamba-2 layers + GQA attention layers (NoPE by default), each followed by
the shared SwiGLU MLP and, in the mixture-of-experts models (num_local_experts > 0: Granite-4.0-H-Tiny, -Small),
routed experts beside it (top-k of the router logits, then softmax over those k, as GraniteMoE; the layer's
feed-forward output is experts + shared MLP; `engine.model.hybrid.blocks.BlockLayer`).

Granite scales the embeddings (`embedding_multiplier`), each residual branch (`residual_multiplier`), the
attention softmax (`attention_multiplier` is the scale itself) and divides the logits by `logits_scaling`.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.model.hybrid.blocks import BlockLayer
from engine.model.hybrid.config import ATTENTION, MAMBA, ConfigError, HybridConfig
from engine.model.hybrid.mamba2 import Mamba2Mixer
from engine.model.moe_config import MoeConfig
from engine.model.moe_loading import build_sparse_moe

_KINDS = {"mamba": MAMBA, "linear_attention": MAMBA, "attention": ATTENTION, "full_attention": ATTENTION}


def experts_from_hf(cfg: dict[str, Any]) -> MoeConfig | None:
    """The routed experts of a Granite-4.0-H MoE config.json (None for the dense models)."""
    n_experts = int(cfg.get("num_local_experts") or 0)
    if n_experts <= 0:
        return None
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act {act!r}: only silu experts are supported")
    return MoeConfig(n_experts=n_experts, top_k=int(cfg.get("num_experts_per_tok") or 0),
                     expert_size=int(cfg["intermediate_size"]), routing="topk_softmax", norm_topk_prob=False)


def config_from_hf(cfg: dict[str, Any]) -> HybridConfig:
    n_layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or cfg.get("layers_block_type") or ["mamba"] * n_layers
    unknown = sorted({t for t in types if t not in _KINDS})
    if unknown:
        raise ConfigError(f"layer_types: unknown Granite layer type(s) {unknown}; expected mamba or attention")
    hidden, n_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // n_heads)
    if cfg.get("attention_bias") or cfg.get("mamba_proj_bias"):
        raise ConfigError("attention_bias / mamba_proj_bias: Granite hybrids with projection biases are not supported")
    return HybridConfig(
        architecture="granitemoehybrid",
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg.get("shared_intermediate_size", 1024)),
        layer_kinds=tuple(_KINDS[t] for t in types),
        n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        **rope_fields(cfg),
        rotary_dim=head_dim if cfg.get("position_embedding_type") == "rope" else 0,
        attention_scale=float(cfg.get("attention_multiplier", 1.0)),
        **mamba_fields(cfg, int(cfg.get("mamba_expand", 2)) * hidden),
        embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
        logits_scaling=float(cfg.get("logits_scaling", 1.0)),
        moe=experts_from_hf(cfg),
    )


def rope_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """rope_theta and rope_scaling from `rope_parameters` / `rope_scaling` (Granite's and Falcon-H1's keys)."""
    rope: dict[str, Any] = dict(cfg.get("rope_parameters") or {})
    rope.update(cfg.get("rope_scaling") or {})
    kind = rope.get("type") or rope.get("rope_type") or "default"
    scaling = None
    if kind != "default":
        scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "type")}
        scaling["rope_type"] = kind
    return {"rope_theta": float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))), "rope_scaling": scaling}


def mamba_fields(cfg: dict[str, Any], inner: int) -> dict[str, Any]:
    """The Mamba-2 shape from `mamba_*` keys (Granite's and Falcon-H1's), for a mixer `inner` channels wide."""
    heads = int(cfg.get("mamba_n_heads", 128))
    head_dim = cfg.get("mamba_d_head", "auto")
    head_dim = inner // heads if head_dim in (None, "auto") else int(head_dim)
    if heads * head_dim != inner:
        raise ConfigError(f"mamba_n_heads ({heads}) x mamba_d_head ({head_dim}) must equal the Mamba width ({inner})")
    low, high = time_step_limit(cfg.get("time_step_limit"))
    return dict(
        conv_kernel=int(cfg.get("mamba_d_conv", 4)), conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        mamba_heads=heads, mamba_head_dim=head_dim, mamba_groups=int(cfg.get("mamba_n_groups", 1)),
        mamba_state_dim=int(cfg.get("mamba_d_state", 256)), mamba_chunk=int(cfg.get("mamba_chunk_size", 256)),
        mamba_dt_min=low, mamba_dt_max=high,
    )


def time_step_limit(value: Any) -> tuple[float, float]:
    """Mamba-2's dt clamp (mamba_ssm's `dt_limit`), default none. `time_step_min`/`_max` only initialise dt_bias
    in training; they are not a clamp."""
    if value is None:
        return 0.0, float("inf")
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise ConfigError(f"time_step_limit: expected [low, high], got {value!r}")
    return _float(value[0]), _float(value[1])


def _float(value: Any) -> float:
    """A float from config.json; transformers writes infinity as {"__float__": "Infinity"}."""
    if isinstance(value, dict) and "__float__" in value:
        return float(value["__float__"])
    return float(value)


HF_LAYER_NAMES = {
    "input_layernorm.weight": "mixer_norm", "post_attention_layernorm.weight": "mlp_norm",
    "self_attn.q_proj.weight": "q", "self_attn.k_proj.weight": "k", "self_attn.v_proj.weight": "v",
    "self_attn.o_proj.weight": "o",
    "mamba.in_proj.weight": "ssm_in", "mamba.conv1d.weight": "conv", "mamba.conv1d.bias": "conv_bias",
    "mamba.dt_bias": "dt_bias", "mamba.A_log": "a_log", "mamba.D": "d_skip", "mamba.norm.weight": "ssm_norm",
    "mamba.out_proj.weight": "ssm_out",
    "shared_mlp.input_linear.weight": "gate_up", "shared_mlp.output_linear.weight": "down",
    "block_sparse_moe.router.layer.weight": "router", "block_sparse_moe.input_linear.weight": "experts.gate_up",
    "block_sparse_moe.output_linear.weight": "experts.down",
}
HF_GLOBAL_NAMES = {"model.embed_tokens.weight": "embed", "model.norm.weight": "norm", "lm_head.weight": "lm_head"}


def gate_up(config: HybridConfig, layer: int, need) -> torch.Tensor:
    """The shared MLP's fused input projection: gate rows then up rows, as the builder expects."""
    return need(f"{layer}.gate_up", (2 * config.intermediate_size, config.hidden_size))


def build_mixer(config: HybridConfig, layer: int, need, opt, to, *, in_factor: float = 1.0, out_factor: float = 1.0,
                in_scale: torch.Tensor | None = None) -> Mamba2Mixer:
    """The Mamba-2 mixer of `layer` (also Nemotron-H's and Falcon-H1's: the same canonical keys); Falcon-H1 passes
    its multipliers (`in_factor` / `out_factor` folded into in_proj / out_proj, `in_scale` on in_proj's output)."""
    c, p = config, f"{layer}."
    d, heads = c.hidden_size, c.mamba_heads
    inner = heads * c.mamba_head_dim
    conv = need(p + "conv", (c.conv_channels, 1, c.conv_kernel)).reshape(c.conv_channels, c.conv_kernel)
    w_in = need(p + "ssm_in", (inner + c.conv_channels + heads, d))
    w_out = need(p + "ssm_out", (d, inner))
    return Mamba2Mixer(
        c, layer, w_in=to(w_in * in_factor if in_factor != 1.0 else w_in), conv=to(conv),
        conv_bias=to(need(p + "conv_bias", (c.conv_channels,))) if c.conv_bias else None,
        a_log=to(need(p + "a_log", (heads,))), dt_bias=to(need(p + "dt_bias", (heads,))),
        d_skip=to(need(p + "d_skip", (heads,))),
        norm=None if c.mamba_norm == "gate_only" else to(need(p + "ssm_norm", (inner,))),
        w_out=to(w_out * out_factor if out_factor != 1.0 else w_out), in_scale=None if in_scale is None else to(in_scale),
    )


def build_layer(config: HybridConfig, layer: int, mixer, get, need, norm, to, path: str) -> torch.nn.Module | None:
    """A layer with routed experts beside the shared MLP; None for the dense models (the usual HybridLayer)."""
    c, p = config, f"{layer}."
    if not c.is_moe_layer(layer):
        return None
    d = c.hidden_size
    moe = build_sparse_moe(c, layer, get, need, to, path)
    return BlockLayer(
        c.layer_kinds[layer], mixer, eps=c.rms_norm_eps, mixer_norm=to(norm(p + "mixer_norm", d)),
        mlp_norm=to(norm(p + "mlp_norm", d)), w_gate_up=to(gate_up(c, layer, need)),
        w_down=to(need(p + "down", (d, c.intermediate_size))), moe=moe, residual_multiplier=c.residual_multiplier,
    )
