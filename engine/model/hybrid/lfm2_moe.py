"""LFM2-MoE (Liquid AI's LFM2-8B-A1B, LFM2-24B-A2B): LFM2's short-convolution and attention layers, with a
mixture-of-experts MLP on every layer after the first `num_dense_layers`.

Over LFM2 it adds only the expert block, routed as transformers' Lfm2MoeTopKRouter does: sigmoid scores, the
top-k experts by score + `expert_bias` (a float32 buffer that only chooses), weights = the chosen scores divided
by their sum + 1e-6 (`norm_topk_prob`), times `routed_scaling_factor` (engine/model/moe_config.py's
`sigmoid_bias` routing, run by engine/model/moe.py's SparseMoe, so `--moe-experts cpu` places its experts in
host RAM as for every MoE family). Its dense MLP is `intermediate_size` wide as given (LFM2's automatic
resizing does not apply). GGUF: llama.cpp's `lfm2moe` (engine/model/hybrid/gguf_loader.py).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from engine.model.hybrid import lfm2
from engine.model.hybrid.config import ConfigError, HybridConfig
from engine.model.moe_config import MoeConfig

NORM_EPS = 1e-6  # what the router adds to the chosen scores' sum (Lfm2MoeTopKRouter)
HF_LAYER_NAMES = {**lfm2.HF_LAYER_NAMES, "feed_forward.gate.weight": "router",
                  "feed_forward.expert_bias": "expert_bias"}
HF_GLOBAL_NAMES = lfm2.HF_GLOBAL_NAMES
build_mixer = lfm2.build_mixer
_EXPERT = re.compile(r"feed_forward\.experts\.(\d+)\.(w1|w2|w3)\.weight")
_PART = {"w1": "gate", "w3": "up", "w2": "down"}


def hf_layer_key(rest: str) -> str | None:
    """The canonical key of one expert's weight ("feed_forward.experts.3.w1.weight" -> "expert.3.gate")."""
    m = _EXPERT.fullmatch(rest)
    return f"expert.{m.group(1)}.{_PART[m.group(2)]}" if m else None


def moe_config(n_experts: int, top_k: int, expert_size: int, n_dense: int, n_layers: int, *, norm: bool,
               scaling: float) -> MoeConfig:
    """The expert settings of an LFM2-MoE model (from config.json or GGUF metadata)."""
    if not 0 <= n_dense <= n_layers:
        raise ConfigError(f"num_dense_layers: expected 0 to {n_layers}, got {n_dense}")
    moe = MoeConfig(n_experts=n_experts, top_k=top_k, expert_size=expert_size, routing="sigmoid_bias",
                    norm_topk_prob=norm, dense_layers=tuple(range(n_dense)), routed_scaling=scaling,
                    norm_eps=NORM_EPS if norm else 0.0)
    try:
        moe.check(n_layers)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return moe


def config_from_hf(cfg: dict[str, Any]) -> HybridConfig:
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {cfg['hidden_act']!r}: only silu experts are supported")
    base = lfm2.config_from_hf({**cfg, "block_auto_adjust_ff_dim": False})
    moe = moe_config(int(cfg["num_experts"]), int(cfg["num_experts_per_tok"]), int(cfg["moe_intermediate_size"]),
                     int(cfg.get("num_dense_layers", 2)), base.n_layers,
                     norm=bool(cfg.get("norm_topk_prob", True)),
                     scaling=float(cfg.get("routed_scaling_factor", 1.0)))
    return dataclasses.replace(base, architecture="lfm2_moe", moe=moe)
