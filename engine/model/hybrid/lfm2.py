"""LFM2 (Liquid AI): gated short-convolution layers + a few GQA attention layers with q/k norms.

A conv layer: in_proj -> (B, C, x); y = C * conv(B * x) with a depthwise causal convolution of width
`conv_L_cache` and no activation; out_proj. Its only state is the conv state (the last L-1 inputs).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.model.hybrid.batch import Batch, apply_conv
from engine.model.hybrid.config import ATTENTION, SHORT_CONV, ConfigError, HybridConfig
from engine.model.projections import linear


class ShortConvMixer(torch.nn.Module):
    # The buffers registered in __init__, typed (nn.Module's attribute lookup is typed Tensor | Module).
    w_in: torch.Tensor
    b_in: torch.Tensor | None
    conv: torch.Tensor
    conv_bias: torch.Tensor | None
    w_out: torch.Tensor
    b_out: torch.Tensor | None

    def __init__(
        self, config: HybridConfig, layer: int, *, w_in: torch.Tensor, conv: torch.Tensor,
        conv_bias: torch.Tensor | None, w_out: torch.Tensor, b_in: torch.Tensor | None = None,
        b_out: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        d = config.hidden_size
        assert w_in.shape == (3 * d, d), ("in_proj", tuple(w_in.shape))
        assert conv.shape == (d, config.conv_kernel), ("conv", tuple(conv.shape))
        assert w_out.shape == (d, d), ("out_proj", tuple(w_out.shape))
        self.layer = layer
        for name, t in (("w_in", w_in), ("b_in", b_in), ("conv", conv), ("conv_bias", conv_bias),
                        ("w_out", w_out), ("b_out", b_out)):
            self.register_buffer(name, t, persistent=False)

    def forward(self, h: torch.Tensor, batch: Batch) -> torch.Tensor:
        d = h.shape[1]
        bcx = linear(h, self.w_in, batch.n_single, self.b_in)
        b, c, x = bcx[:, :d], bcx[:, d : 2 * d], bcx[:, 2 * d :]
        y = c * apply_conv(b * x, self.conv, self.conv_bias, self.layer, batch)
        return linear(y, self.w_out, batch.n_single, self.b_out)


def mlp_size(cfg: dict[str, Any]) -> int:
    """LFM2's feed-forward width: config.json's intermediate_size, shrunk as transformers' Lfm2MLP does."""
    size = int(cfg.get("block_ff_dim") or cfg["intermediate_size"])
    if cfg.get("block_auto_adjust_ff_dim", True):
        size = int(2 * size / 3)
        multiplier = cfg.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:
            size = int(multiplier * size)
            multiple = int(cfg.get("block_multiple_of", 256))
            size = multiple * ((size + multiple - 1) // multiple)
    return size


def config_from_hf(cfg: dict[str, Any]) -> HybridConfig:
    n_layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        attn = set(cfg.get("full_attn_idxs") or range(n_layers))
        types = ["full_attention" if i in attn else "conv" for i in range(n_layers)]
    kinds = []
    for t in types:
        if t not in ("full_attention", "conv"):
            raise ConfigError(f"layer_types: unknown LFM2 layer type {t!r}; expected full_attention or conv")
        kinds.append(ATTENTION if t == "full_attention" else SHORT_CONV)
    hidden, n_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // n_heads)
    rope: dict[str, Any] = dict(cfg.get("rope_parameters") or {})
    rope.update(cfg.get("rope_scaling") or {})
    theta = float(cfg.get("rope_theta", rope.pop("rope_theta", 1000000.0)))
    kind = rope.pop("type", None) or rope.get("rope_type") or "default"
    rope["rope_type"] = kind
    return HybridConfig(
        architecture="lfm2",
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=mlp_size(cfg),
        layer_kinds=tuple(kinds),
        n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("norm_eps", 1e-5)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 128000)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", cfg.get("tie_embedding", True))),
        rope_theta=theta,
        rope_scaling=None if kind == "default" else rope,
        rotary_dim=head_dim,
        qk_norm=True,
        conv_kernel=int(cfg.get("conv_L_cache", 3)),
        conv_bias=bool(cfg.get("conv_bias", False)),
    )


# HF tensor names (after "model.layers.<i>.") -> canonical keys the builder asks for.
HF_LAYER_NAMES = {
    "operator_norm.weight": "mixer_norm", "ffn_norm.weight": "mlp_norm",
    "self_attn.q_proj.weight": "q", "self_attn.k_proj.weight": "k", "self_attn.v_proj.weight": "v",
    "self_attn.out_proj.weight": "o", "self_attn.q_layernorm.weight": "q_norm",
    "self_attn.k_layernorm.weight": "k_norm",
    "conv.in_proj.weight": "conv_in", "conv.in_proj.bias": "conv_in_bias", "conv.conv.weight": "conv",
    "conv.conv.bias": "conv_bias", "conv.out_proj.weight": "conv_out", "conv.out_proj.bias": "conv_out_bias",
    "feed_forward.w1.weight": "gate", "feed_forward.w3.weight": "up", "feed_forward.w2.weight": "down",
}
HF_GLOBAL_NAMES = {"model.embed_tokens.weight": "embed", "model.embedding_norm.weight": "norm", "lm_head.weight": "lm_head"}


def build_mixer(config: HybridConfig, layer: int, need, opt, to) -> torch.nn.Module:
    """The recurrent mixer of `layer` from canonical weights (need/opt read a key, `to` places a tensor)."""
    c, p = config, f"{layer}."
    d = c.hidden_size
    conv = need(p + "conv", (d, 1, c.conv_kernel)).reshape(d, c.conv_kernel)
    return ShortConvMixer(
        c, layer, w_in=to(need(p + "conv_in", (3 * d, d))), conv=to(conv),
        conv_bias=to(need(p + "conv_bias", (d,))) if c.conv_bias else None,
        w_out=to(need(p + "conv_out", (d, d))),
        b_in=to(need(p + "conv_in_bias", (3 * d,))) if c.conv_bias else None,
        b_out=to(need(p + "conv_out_bias", (d,))) if c.conv_bias else None,
    )
