"""Nemotron-H (`nemotron_h`, NVIDIA): a stack of single blocks, each one RMSNorm, one part and a residual.

The layer pattern (`layers_block_type`, or the older `hybrid_override_pattern` string) picks each block's part:
"M" / linear_attention a Mamba-2 mixer (the same SSD scan as Granite-4.0-H, its gated RMSNorm normalised per group,
dt clamped to `time_step_limit`, no clamp by default), "*" / full_attention GQA attention without
any position encoding (softmax scale 1/sqrt(head_dim)), "-" / mlp an ungated feed-forward down(relu(up x)^2).
"E" / moe a mixture-of-experts feed-forward (Nemotron-3 Nano: sigmoid routing with a score-correction bias, relu2
experts and a shared one; `engine.model.hybrid.nemotron_moe`). Checkpoints name the model `backbone.*`.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from engine.errors import ModelLoadError
from engine.model.hybrid import granitemoehybrid
from engine.model.hybrid.blocks import BlockLayer
from engine.model.hybrid.config import ATTENTION, MAMBA, MLP, ConfigError, HybridConfig
from engine.model.hybrid.nemotron_config import NemotronExperts
from engine.model.hybrid.nemotron_moe import NemotronMoe

# A MoE block is a feed-forward-only block too (kind MLP); `moe_layers` says which ones run experts.
_KINDS = {"M": MAMBA, "linear_attention": MAMBA, "mamba": MAMBA, "*": ATTENTION, "full_attention": ATTENTION,
          "attention": ATTENTION, "-": MLP, "mlp": MLP, "E": MLP, "moe": MLP}
_MOE = ("E", "moe")


def _types(cfg: dict[str, Any]) -> list[str]:
    types = cfg.get("layers_block_type") or cfg.get("layer_types") or cfg.get("hybrid_override_pattern")
    if not types:
        raise ConfigError("layers_block_type (or hybrid_override_pattern) is missing")
    unknown = sorted({str(t) for t in types if t not in _KINDS})
    if unknown:
        raise ConfigError(f"layers_block_type: unknown Nemotron-H block type(s) {unknown}; expected "
                          "linear_attention (M), full_attention (*), mlp (-) or moe (E)")
    return list(types)


def layer_kinds(cfg: dict[str, Any]) -> tuple[str, ...]:
    """The layer kinds from `layers_block_type` (a list) or `hybrid_override_pattern` (a string such as "M-M*-")."""
    return tuple(_KINDS[t] for t in _types(cfg))


def moe_layers(cfg: dict[str, Any]) -> tuple[int, ...]:
    return tuple(i for i, t in enumerate(_types(cfg)) if t in _MOE)


def experts_from_hf(cfg: dict[str, Any]) -> NemotronExperts | None:
    layers = moe_layers(cfg)
    if not layers:
        return None
    latent = cfg.get("moe_latent_size")
    return NemotronExperts(
        layers=layers, n_experts=int(cfg["n_routed_experts"]), top_k=int(cfg["num_experts_per_tok"]),
        expert_size=int(cfg["moe_intermediate_size"]), shared_size=int(cfg["moe_shared_expert_intermediate_size"]),
        n_group=int(cfg.get("n_group") or 1), topk_group=int(cfg.get("topk_group") or 1),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)), scaling=float(cfg.get("routed_scaling_factor", 1.0)),
        latent_size=int(latent or 0),
    )


def _key(cfg: dict[str, Any], name: str, old: str, default: Any) -> Any:
    """A config value under its current name, or the older `mamba_*` one transformers still reads."""
    value = cfg.get(name, cfg.get(old))
    return default if value is None else value


def config_from_hf(cfg: dict[str, Any]) -> HybridConfig:
    for flag in ("mlp_bias", "use_bias", "mamba_proj_bias"):
        if cfg.get(flag):
            raise ConfigError(f"{flag} is true: Nemotron-H models with projection biases are not supported")
    act = cfg.get("mlp_hidden_act", "relu2")
    if act != "relu2":
        raise ConfigError(f"mlp_hidden_act {act!r}: only relu2 (Nemotron-H's) is supported")
    if cfg.get("mamba_hidden_act", "silu") != "silu":
        raise ConfigError(f"mamba_hidden_act {cfg['mamba_hidden_act']!r}: only silu is supported")
    kinds = layer_kinds(cfg)
    hidden, n_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or cfg.get("attention_head_dim") or hidden // n_heads)
    dt_low, dt_high = granitemoehybrid.time_step_limit(_key(cfg, "time_step_limit", "mamba_dt_limit", None))
    return HybridConfig(
        architecture="nemotron_h",
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg.get("intermediate_size") or cfg.get("moe_intermediate_size") or 1),
        layer_kinds=kinds,
        n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        conv_kernel=int(_key(cfg, "conv_kernel", "mamba_d_conv", 4)),
        conv_bias=bool(_key(cfg, "use_conv_bias", "mamba_conv_bias", True)),
        mamba_heads=int(cfg.get("mamba_num_heads", 128)),
        mamba_head_dim=int(cfg.get("mamba_head_dim", 64)),
        mamba_groups=int(_key(cfg, "n_groups", "mamba_n_groups", 8)),
        mamba_state_dim=int(cfg.get("ssm_state_size", 128)),
        mamba_chunk=int(_key(cfg, "chunk_size", "mamba_chunk_size", 128)),
        # dt clamped to time_step_limit (mamba_ssm's dt_limit, default none), as transformers >= 5.25 and
        # llama.cpp compute it; time_step_min only initialises dt_bias (docs/DETAILS.md, "Nemotron-H's dt")
        mamba_dt_min=dt_low, mamba_dt_max=dt_high,
        nemotron_experts=experts_from_hf(cfg),
    )


HF_LAYER_NAMES = {
    "norm.weight": "layer_norm",
    "mixer.q_proj.weight": "q", "mixer.k_proj.weight": "k", "mixer.v_proj.weight": "v", "mixer.o_proj.weight": "o",
    "mixer.in_proj.weight": "ssm_in", "mixer.conv1d.weight": "conv", "mixer.conv1d.bias": "conv_bias",
    "mixer.dt_bias": "dt_bias", "mixer.A_log": "a_log", "mixer.D": "d_skip", "mixer.norm.weight": "ssm_norm",
    "mixer.out_proj.weight": "ssm_out",
    "mixer.up_proj.weight": "up", "mixer.down_proj.weight": "down",
    # MoE blocks (also transformers 5's stacked expert names)
    "mixer.gate.weight": "router", "mixer.gate.e_score_correction_bias": "score_bias",
    "mixer.gate.e_score_correction.bias": "score_bias",
    "mixer.experts.up_proj": "experts.up", "mixer.experts.down_proj": "experts.down",
    "mixer.shared_experts.up_proj.weight": "shared_up", "mixer.shared_experts.down_proj.weight": "shared_down",
    "mixer.fc1_latent_proj.weight": "latent_in", "mixer.fc2_latent_proj.weight": "latent_out",
}
_HF_EXPERT = re.compile(r"mixer\.experts\.(\d+)\.(up|down)_proj\.weight")


def hf_layer_key(rest: str) -> str | None:
    """The canonical key of one expert's matrix ("mixer.experts.3.up_proj.weight" -> "expert.3.up")."""
    m = _HF_EXPERT.fullmatch(rest)
    return f"expert.{m.group(1)}.{m.group(2)}" if m else None
# After the loader's "backbone." -> "model." rewrite.
HF_GLOBAL_NAMES = {"model.embeddings.weight": "embed", "model.norm_f.weight": "norm", "lm_head.weight": "lm_head"}


def build_mixer(config: HybridConfig, layer: int, need, opt, to) -> torch.nn.Module | None:
    """The Mamba-2 mixer of an "M" block (Granite-4.0-H's, same canonical keys); MLP blocks have no mixer."""
    if config.layer_kinds[layer] == MLP:
        return None
    return granitemoehybrid.build_mixer(config, layer, need, opt, to)


def build_layer(config: HybridConfig, layer: int, mixer, get, need, norm, to, path: str) -> torch.nn.Module:
    """One block: its norm and either its mixer (Mamba-2 or attention) or its relu2 feed-forward."""
    c, p = config, f"{layer}."
    d, inter = c.hidden_size, c.intermediate_size
    weight = to(norm(p + "layer_norm", d))
    if c.layer_kinds[layer] != MLP:
        return BlockLayer(c.layer_kinds[layer], mixer, eps=c.rms_norm_eps, mixer_norm=weight)
    if c.nemotron_experts is not None and layer in c.nemotron_experts.layers:
        return BlockLayer(MLP, None, eps=c.rms_norm_eps, mlp_norm=weight, moe=_experts(c, layer, get, need, to))
    return BlockLayer(MLP, None, eps=c.rms_norm_eps, mlp_norm=weight, w_gate_up=to(need(p + "up", (inter, d))),
                      w_down=to(need(p + "down", (d, inter))), act="relu2")


def _experts(config: HybridConfig, layer: int, get, need, to) -> NemotronMoe:
    """A MoE block's experts from stacked ("i.experts.up", GGUF and transformers 5) or per-expert keys."""
    s, p, d = config.nemotron_experts, f"{layer}.", config.hidden_size
    assert s is not None
    width = s.latent_size or d

    def stacked(part: str, shape: tuple[int, int]) -> torch.Tensor:
        t = get(p + "experts." + part)
        if t is None:
            t = torch.stack([need(f"{p}expert.{j}.{part}", shape) for j in range(s.n_experts)])
        if tuple(t.shape) != (s.n_experts, *shape):
            raise ModelLoadError(f"weight {p}experts.{part!r} has shape {tuple(t.shape)}, expected {(s.n_experts, *shape)}")
        return t

    latent = ({"latent_in": to(need(p + "latent_in", (width, d))), "latent_out": to(need(p + "latent_out", (d, width)))}
              if s.latent_size else {})
    device = to(torch.zeros(1)).device  # the router and its bias stay float32, as transformers keeps them
    return NemotronMoe(
        s, d, router=need(p + "router", (s.n_experts, d)).float().to(device),
        score_bias=need(p + "score_bias", (s.n_experts,)).float().to(device),
        up=to(stacked("up", (s.expert_size, width))), down=to(stacked("down", (width, s.expert_size))),
        shared_up=to(need(p + "shared_up", (s.shared_size, d))), shared_down=to(need(p + "shared_down", (d, s.shared_size))),
        **latent,
    )
