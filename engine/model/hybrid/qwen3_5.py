"""Qwen3.5 (text): gated DeltaNet layers + gated attention layers (3:1 by default).

Attention: q_proj yields per head the query and a sigmoid output gate (interleaved per head), q/k RMSNorm,
RoPE on the leading `partial_rotary_factor` of each head (the multimodal RoPE sections all carry the same
position for text, so it is plain RoPE). Every RMSNorm outside the DeltaNet stores its weight as w - 1
(`NORM_OFFSET`); the DeltaNet's own gated norm does not. Vision-language checkpoints
(Qwen3_5ForConditionalGeneration) load their text model (`text_config`, "model.language_model." weights).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.model.hybrid.config import ATTENTION, DELTA, ConfigError, HybridConfig
from engine.model.hybrid.gated_deltanet import GatedDeltaNetMixer
from engine.model.moe_config import MoeConfig

NORM_OFFSET = 1.0


def config_from_hf(cfg: dict[str, Any]) -> HybridConfig:
    return text_config(cfg, "qwen3_5", int(cfg["intermediate_size"]))


def text_config(cfg: dict[str, Any], architecture: str, intermediate_size: int, moe: MoeConfig | None = None
                ) -> HybridConfig:
    """The shape shared by the gated-DeltaNet families (Qwen3.5, Qwen3.5-MoE, Qwen3-Next: the same config keys
    and layer types); each names itself and gives its dense MLP size and its experts."""
    n_layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        interval = int(cfg.get("full_attention_interval", 4))
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layers)]
    kinds = []
    for t in types:
        if t not in ("full_attention", "linear_attention"):
            raise ConfigError(f"layer_types: unknown layer type {t!r}; expected full_attention or linear_attention")
        kinds.append(ATTENTION if t == "full_attention" else DELTA)
    hidden, n_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // n_heads)
    rope: dict[str, Any] = dict(cfg.get("rope_parameters") or {})
    rope.update(cfg.get("rope_scaling") or {})
    theta = float(cfg.get("rope_theta", rope.get("rope_theta", 10000000.0)))
    factor = float(cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.25)))
    kind = rope.get("type") or rope.get("rope_type") or "default"
    scaling = None
    if kind != "default":
        scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor", "mrope_section",
                                                               "mrope_interleaved", "type")}
        scaling["rope_type"] = kind
    if cfg.get("attention_bias"):
        raise ConfigError("attention_bias: attention with biases is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {cfg['hidden_act']!r}: only silu is supported")
    return HybridConfig(
        architecture=architecture,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=intermediate_size,
        layer_kinds=tuple(kinds),
        n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_theta=theta,
        rope_scaling=scaling,
        rotary_dim=int(head_dim * factor) // 2 * 2,
        attention_gate=True,
        qk_norm=True,
        conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
        linear_k_heads=int(cfg.get("linear_num_key_heads", 16)),
        linear_v_heads=int(cfg.get("linear_num_value_heads", 32)),
        linear_k_dim=int(cfg.get("linear_key_head_dim", 128)),
        linear_v_dim=int(cfg.get("linear_value_head_dim", 128)),
        moe=moe,
    )


HF_LAYER_NAMES = {
    "input_layernorm.weight": "mixer_norm", "post_attention_layernorm.weight": "mlp_norm",
    "self_attn.q_proj.weight": "q", "self_attn.k_proj.weight": "k", "self_attn.v_proj.weight": "v",
    "self_attn.o_proj.weight": "o", "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
    "linear_attn.in_proj_qkv.weight": "dn_qkv", "linear_attn.in_proj_z.weight": "dn_z",
    "linear_attn.in_proj_b.weight": "dn_b", "linear_attn.in_proj_a.weight": "dn_a",
    "linear_attn.conv1d.weight": "conv", "linear_attn.dt_bias": "dt_bias", "linear_attn.A_log": "a_log",
    "linear_attn.norm.weight": "dn_norm", "linear_attn.out_proj.weight": "dn_out",
    "mlp.gate_proj.weight": "gate", "mlp.up_proj.weight": "up", "mlp.down_proj.weight": "down",
}
HF_GLOBAL_NAMES = {"model.embed_tokens.weight": "embed", "model.norm.weight": "norm", "lm_head.weight": "lm_head"}


def build_mixer(config: HybridConfig, layer: int, need, opt, to) -> torch.nn.Module:
    c, p = config, f"{layer}."
    d, hv = c.hidden_size, c.linear_v_heads
    w_in = torch.cat((
        need(p + "dn_qkv", (c.conv_channels, d)), need(p + "dn_z", (hv * c.linear_v_dim, d)),
        need(p + "dn_b", (hv, d)), need(p + "dn_a", (hv, d)),
    ))
    return deltanet_mixer(c, layer, w_in, need, to)


def deltanet_mixer(config: HybridConfig, layer: int, w_in: torch.Tensor, need, to) -> GatedDeltaNetMixer:
    """The gated DeltaNet of `layer` around its input projection `w_in` (rows q | k | v | z | b | a, value heads
    grouped by key head) from the layer's other canonical keys."""
    c, p = config, f"{layer}."
    d, hv = c.hidden_size, c.linear_v_heads
    value_dim = hv * c.linear_v_dim
    conv = need(p + "conv", (c.conv_channels, 1, c.conv_kernel)).reshape(c.conv_channels, c.conv_kernel)
    return GatedDeltaNetMixer(
        c, layer, w_in=to(w_in), conv=to(conv), a_log=to(need(p + "a_log", (hv,))),
        dt_bias=to(need(p + "dt_bias", (hv,))), norm=to(need(p + "dn_norm", (c.linear_v_dim,))),
        w_out=to(need(p + "dn_out", (d, value_dim))),
    )
