"""Qwen3.5-MoE (text): Qwen3.5's layers with an expert block on every layer (no dense MLP at all).

transformers' Qwen3_5MoeTextConfig has no intermediate_size, decoder_sparse_step, norm_topk_prob or
mlp_only_layers: every layer routes softmax -> top-k -> renormalised over the k (Qwen3-VL-MoE's router), plus
the shared expert behind its sigmoid gate (Qwen3-Next's block). Vision-language checkpoints
(Qwen3_5MoeForConditionalGeneration) load their text model, as for Qwen3.5. GGUF (llama.cpp's `qwen35moe`):
engine/model/hybrid/gguf_qwen35.py.
"""

from __future__ import annotations

from typing import Any

from engine.model.hybrid import qwen3_5
from engine.model.hybrid.config import ConfigError, HybridConfig
from engine.model.moe_config import moe_from_hf

NORM_OFFSET = 1.0
HF_LAYER_NAMES = qwen3_5.HF_LAYER_NAMES
HF_GLOBAL_NAMES = qwen3_5.HF_GLOBAL_NAMES
build_mixer = qwen3_5.build_mixer


def config_from_hf(cfg: dict[str, Any]) -> HybridConfig:
    fixed = {**cfg, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}
    try:
        moe = moe_from_hf("qwen2_moe", fixed)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    # no dense layer: the MLP size is the experts' (it only sizes estimates)
    return qwen3_5.text_config(cfg, "qwen3_5_moe", moe.expert_size, moe)
