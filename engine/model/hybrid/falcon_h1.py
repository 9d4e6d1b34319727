"""Falcon-H1 (`falcon_h1`, TII): every layer runs attention and a Mamba-2 mixer side by side on the same normed
input and adds both to the residual, then a SwiGLU MLP (layer kind "parallel": K/V and a Mamba-2 state).

Falcon's muP multipliers are applied at load, so the forward needs almost none of them: `ssm_in_multiplier`
folded into in_proj, `ssm_out_multiplier` into out_proj, `attention_in_multiplier` into q/k/v, `key_multiplier`
into k (RoPE is linear), `attention_out_multiplier` into o, `mlp_multipliers` into the gate and down rows;
`embedding_multiplier` scales the embeddings and `lm_head_multiplier` the logits. `ssm_multipliers` (one per part
of in_proj's output rows: z, x, B, C, dt) scale the projection's output, as transformers does (folded into the rows,
the logits drift ~3x further from a float64 forward). RoPE on the whole head. The Mamba-2 output is gated only, or
(`mamba_rms_norm`) normalised per group before (`mamba_norm_before_gate`) or after the gate.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.model.hybrid import granitemoehybrid
from engine.model.hybrid.attention import AttentionMixer
from engine.model.hybrid.batch import Batch
from engine.model.hybrid.blocks import BlockLayer
from engine.model.hybrid.config import PARALLEL, ConfigError, HybridConfig
from engine.model.hybrid.granitemoehybrid import mamba_fields, rope_fields
from engine.model.hybrid.mamba2 import Mamba2Mixer

_SCALARS = ("ssm_in_multiplier", "ssm_out_multiplier", "attention_in_multiplier", "attention_out_multiplier",
            "key_multiplier")


def neutral_multipliers() -> dict[str, Any]:
    """Every multiplier 1 (a GGUF file has them folded into its weights already)."""
    return {**{name: 1.0 for name in _SCALARS}, "ssm_multipliers": [1.0] * 5, "mlp_multipliers": [1.0] * 2}


def _multipliers(cfg: dict[str, Any], name: str, n: int) -> list[float]:
    values = cfg.get(name) or [1.0] * n
    if len(values) != n:
        raise ConfigError(f"{name}: expected {n} values, got {values!r}")
    return [float(v) for v in values]


def config_from_hf(cfg: dict[str, Any]) -> HybridConfig:
    for flag in ("attention_bias", "mlp_bias", "mamba_proj_bias", "projectors_bias"):
        if cfg.get(flag):
            raise ConfigError(f"{flag} is true: Falcon-H1 models with projection biases are not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {cfg['hidden_act']!r}: only silu is supported")
    hidden, n_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // n_heads)
    inner = int(cfg.get("mamba_d_ssm") or int(cfg.get("mamba_expand", 2)) * hidden)
    multipliers: dict[str, Any] = {name: float(cfg.get(name, 1.0)) for name in _SCALARS}
    multipliers["ssm_multipliers"] = _multipliers(cfg, "ssm_multipliers", 5)
    multipliers["mlp_multipliers"] = _multipliers(cfg, "mlp_multipliers", 2)
    norm = "gate_only"
    if cfg.get("mamba_rms_norm"):
        norm = "norm_then_gate" if cfg.get("mamba_norm_before_gate", True) else "gated"
    return HybridConfig(
        architecture="falcon_h1",
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        layer_kinds=(PARALLEL,) * int(cfg["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        **rope_fields(cfg),
        rotary_dim=head_dim,
        **mamba_fields(cfg, inner),
        mamba_norm=norm,
        embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
        logits_scaling=1.0 / float(cfg.get("lm_head_multiplier", 1.0)),
        multipliers=multipliers,
    )


HF_LAYER_NAMES = {
    "input_layernorm.weight": "mixer_norm", "pre_ff_layernorm.weight": "mlp_norm",
    "self_attn.q_proj.weight": "q", "self_attn.k_proj.weight": "k", "self_attn.v_proj.weight": "v",
    "self_attn.o_proj.weight": "o",
    "mamba.in_proj.weight": "ssm_in", "mamba.conv1d.weight": "conv", "mamba.conv1d.bias": "conv_bias",
    "mamba.dt_bias": "dt_bias", "mamba.A_log": "a_log", "mamba.D": "d_skip", "mamba.norm.weight": "ssm_norm",
    "mamba.out_proj.weight": "ssm_out",
    "feed_forward.gate_proj.weight": "gate", "feed_forward.up_proj.weight": "up", "feed_forward.down_proj.weight": "down",
}
HF_GLOBAL_NAMES = {"model.embed_tokens.weight": "embed", "model.final_layernorm.weight": "norm",
                   "lm_head.weight": "lm_head"}


class ParallelMixer(torch.nn.Module):
    """Mamba-2 and attention on the same input, their outputs added (the multipliers are in their weights)."""

    def __init__(self, mamba: Mamba2Mixer, attention: AttentionMixer) -> None:
        super().__init__()
        self.mamba, self.attention = mamba, attention

    def forward(self, h: torch.Tensor, batch: Batch) -> torch.Tensor:
        return self.mamba(h, batch) + self.attention(h, batch)


def _folds(config: HybridConfig) -> dict[str, Any]:
    assert config.multipliers is not None, "a Falcon-H1 config carries its multipliers"
    return config.multipliers


def build_mixer(config: HybridConfig, layer: int, need, opt, to) -> torch.nn.Module:
    return _mamba(config, layer, need, to)


def _mamba(config: HybridConfig, layer: int, need, to) -> Mamba2Mixer:
    """The Mamba-2 mixer with ssm_in_multiplier / ssm_out_multiplier folded in and ssm_multipliers as its
    in_proj output scale (one per part of the rows: z, x, B, C, dt)."""
    c, m = config, _folds(config)
    inner, bc = c.mamba_heads * c.mamba_head_dim, c.mamba_groups * c.mamba_state_dim
    parts = (inner, inner, bc, bc, c.mamba_heads)
    scale = torch.cat([torch.full((n,), v) for n, v in zip(parts, m["ssm_multipliers"], strict=True)])
    return granitemoehybrid.build_mixer(
        c, layer, need, None, to, in_factor=m["ssm_in_multiplier"], out_factor=m["ssm_out_multiplier"],
        in_scale=scale if bool((scale != 1.0).any()) else None,
    )


def build_layer(config: HybridConfig, layer: int, mixer, get, need, norm, to, path: str) -> torch.nn.Module:
    c, p, m = config, f"{layer}.", _folds(config)
    d, hd, inter = c.hidden_size, c.head_dim, c.intermediate_size
    q_rows, kv_rows = c.n_heads * hd, c.n_kv_heads * hd
    a = m["attention_in_multiplier"]
    wqkv = torch.cat((need(p + "q", (q_rows, d)) * a, need(p + "k", (kv_rows, d)) * (a * m["key_multiplier"]),
                      need(p + "v", (kv_rows, d)) * a))
    attention = AttentionMixer(c, c.attention_layers.index(layer), wqkv=to(wqkv),
                               wo=to(need(p + "o", (d, q_rows)) * m["attention_out_multiplier"]))
    gate_mult, down_mult = m["mlp_multipliers"]
    gate_up = torch.cat((need(p + "gate", (inter, d)) * gate_mult, need(p + "up", (inter, d))))
    return BlockLayer(PARALLEL, ParallelMixer(mixer, attention), eps=c.rms_norm_eps,
                      mixer_norm=to(norm(p + "mixer_norm", d)), mlp_norm=to(norm(p + "mlp_norm", d)),
                      w_gate_up=to(gate_up), w_down=to(need(p + "down", (d, inter)) * down_mult))
