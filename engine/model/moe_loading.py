"""Loading mixture-of-experts weights: checkpoint names -> canonical keys, one layer's SparseMoe, Granite's scalars.

Canonical keys of a MoE layer i (what a loader's getter answers, as CPU tensors):
  "i.router"                    [n_experts, hidden]
  "i.experts.gate_up"           [n_experts, 2 * expert_size, hidden]   fused (transformers 5, GraniteMoE)
  "i.experts.gate", ".up"       [n_experts, expert_size, hidden]       stacked (GGUF ffn_gate_exps / ffn_up_exps)
  "i.experts.down"              [n_experts, hidden, expert_size]
  "i.expert.E.gate", ".up", ".down"                                    one expert at a time (HF checkpoints)
  "i.shared.gate", ".up", ".down", "i.shared_gate"                     Qwen2-MoE's shared expert and its gate
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import torch

from engine.errors import ModelLoadError
from engine.model.config import ModelConfig
from engine.model.moe import SparseMoe

Getter = Callable[[str], "torch.Tensor | None"]

_HF_FIXED = {
    "mlp.gate.weight": "router",  # Qwen*, OLMoE
    "block_sparse_moe.gate.weight": "router",  # Mixtral
    "block_sparse_moe.router.layer.weight": "router",  # GraniteMoE
    "mlp.experts.gate_up_proj": "experts.gate_up",  # transformers 5's own parameter names
    "mlp.experts.down_proj": "experts.down",
    "block_sparse_moe.input_linear.weight": "experts.gate_up",  # GraniteMoE: [gate; up] per expert
    "block_sparse_moe.output_linear.weight": "experts.down",
    "mlp.shared_expert.gate_proj.weight": "shared.gate",  # Qwen2-MoE
    "mlp.shared_expert.up_proj.weight": "shared.up",
    "mlp.shared_expert.down_proj.weight": "shared.down",
    "mlp.shared_expert_gate.weight": "shared_gate",
}
_HF_EXPERT = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight")
_HF_EXPERT_PART = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


def hf_layer_key(rest: str) -> str | None:
    """The canonical key (without the layer prefix) of an HF layer tensor name such as
    "mlp.experts.3.up_proj.weight", or None when it is not a MoE tensor."""
    key = _HF_FIXED.get(rest)
    if key is not None:
        return key
    m = _HF_EXPERT.fullmatch(rest)
    return f"expert.{m.group(1)}.{_HF_EXPERT_PART[m.group(2)]}" if m else None


def q_norm_shapes(config: ModelConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the q and k norm weights: one per head dim (Qwen3*), or the full q / k width (OLMoE)."""
    c = config
    if c.architecture == "olmoe":
        return (c.n_heads * c.head_dim,), (c.n_kv_heads * c.head_dim,)
    return (c.head_dim,), (c.head_dim,)


def fold_scales(config: ModelConfig, get: Getter) -> Getter:
    """A getter that folds GraniteMoE's multipliers into the weights, so the forward pass needs none of them:
    embeddings * embedding_multiplier, q rows * attention_multiplier * sqrt(head_dim) (SDPA then applies
    1/sqrt(head_dim)), attention output and expert down rows * residual_multiplier, output rows / logits_scaling
    (with tied embeddings, the unscaled embeddings / logits_scaling). Other models get `get` itself."""
    m = config.moe
    if m is None or (m.embedding_multiplier == m.residual_multiplier == m.logits_scaling == 1.0
                     and m.attention_multiplier is None):
        return get
    q_scale = 1.0 if m.attention_multiplier is None else m.attention_multiplier * math.sqrt(config.head_dim)

    def scaled(key: str) -> torch.Tensor | None:
        if key == "lm_head" and config.tie_word_embeddings:
            key = "embed_for_output"
        t = get("embed" if key == "embed_for_output" else key)
        if t is None:
            return None
        part = key.rsplit(".", 1)[-1]
        if key == "embed":
            factor = m.embedding_multiplier
        elif key in ("lm_head", "embed_for_output"):
            factor = 1.0 / m.logits_scaling
        elif part in ("q", "q_bias"):
            factor = q_scale
        elif part in ("o", "down"):  # every tensor that writes into the residual stream from inside a layer
            factor = m.residual_multiplier
        else:
            return t
        return t if factor == 1.0 else t * factor

    return scaled


def output_is_separate(config: ModelConfig) -> bool:
    """Whether the output matrix must be built apart from the embeddings even when they are tied."""
    m = config.moe
    return m is not None and (m.embedding_multiplier != 1.0 or m.logits_scaling != 1.0)


def build_sparse_moe(
    config: ModelConfig,
    index: int,
    get: Getter,
    need: Callable[[str, tuple[int, ...]], torch.Tensor],
    to: Callable[[torch.Tensor], torch.Tensor],
    path: str,
) -> SparseMoe:
    """Layer `index`'s expert block from canonical keys (see the module docstring), on the device `to` moves to."""
    c, m = config, config.moe
    assert m is not None and c.is_moe_layer(index), index
    p = f"{index}."
    e, inter, h = m.n_experts, m.expert_size, c.hidden_size
    gate_up = get(p + "experts.gate_up")
    if gate_up is None:
        gate, up = get(p + "experts.gate"), get(p + "experts.up")
        if gate is not None and up is not None:
            _check(gate, (e, inter, h), p + "experts.gate", path)
            _check(up, (e, inter, h), p + "experts.up", path)
            gate_up = torch.cat((gate, up), dim=1)
        else:
            gate_up = torch.stack([torch.cat((need(f"{p}expert.{j}.gate", (inter, h)),
                                              need(f"{p}expert.{j}.up", (inter, h)))) for j in range(e)])
    _check(gate_up, (e, 2 * inter, h), p + "experts.gate_up", path)
    down = get(p + "experts.down")
    if down is None:
        down = torch.stack([need(f"{p}expert.{j}.down", (h, inter)) for j in range(e)])
    _check(down, (e, h, inter), p + "experts.down", path)
    shared = {}
    if m.shared_expert_size:
        s = m.shared_expert_size
        shared = {
            "shared_gate_up": to(torch.cat((need(p + "shared.gate", (s, h)), need(p + "shared.up", (s, h))))),
            "shared_down": to(need(p + "shared.down", (h, s))),
            "shared_gate": to(need(p + "shared_gate", (1, h))),
        }
    return SparseMoe(m, h, router=to(need(p + "router", (e, h))), gate_up=to(gate_up), down=to(down), **shared)


def _check(t: torch.Tensor, shape: tuple[int, ...], key: str, path: str) -> None:
    if tuple(t.shape) != shape:
        raise ModelLoadError(f"{path}: weight {key!r} has shape {tuple(t.shape)}, expected {shape}")


def mlp_weights(config: ModelConfig, index: int) -> int:
    """Number of MLP weights of layer `index` (experts, router and shared expert for MoE layers)."""
    c, m = config, config.moe
    if not c.is_moe_layer(index):
        return 3 * c.hidden_size * c.intermediate_size
    shared = 3 * c.hidden_size * m.shared_expert_size + c.hidden_size if m.shared_expert_size else 0
    return m.n_experts * (3 * c.hidden_size * m.expert_size + c.hidden_size) + shared
