"""How many bytes a hybrid model's layer needs on its device: what `plan_stages` weighs a split and checks
free memory with (an upper estimate: projections, K/V of an attention layer, recurrent state of the others)."""

from __future__ import annotations

import torch

from engine.model.hybrid.config import PARALLEL, RECURRENT_KINDS, HybridConfig
from engine.model.hybrid.recurrent_state import StateLayout


def layer_bytes(config: HybridConfig, dtype: torch.dtype, n_slots: int, ctx: int,
                cpu_experts: frozenset[int] = frozenset()) -> int:
    """The largest layer's weights plus its per-slot state (K/V rows for `ctx` tokens, or a recurrent state);
    the routed experts of the layers in `cpu_experts` are in host RAM, not on the layer's device."""
    c = config
    mlp = max(_mlp_weights(c, i, i in cpu_experts) for i in range(c.n_layers))
    if c.nemotron_experts is not None:  # relu2 experts (up, down), the shared one and the router
        e = c.nemotron_experts
        mlp = max(mlp, 2 * (e.n_experts * e.expert_size + e.shared_size) * c.hidden_size + e.n_experts * c.hidden_size)
    q_rows, kv_rows = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    attention = (c.hidden_size * (q_rows * (2 if c.attention_gate else 1) + 2 * kv_rows) + q_rows * c.hidden_size
                 + 2 * n_slots * ctx * kv_rows)
    # a recurrent layer's projections read and write its convolution channels (an upper bound for every family)
    recurrent = 3 * c.hidden_size * max(c.conv_channels, c.hidden_size)
    state = StateLayout.for_config(c, torch.float32)
    n_recurrent = sum(1 for k in c.layer_kinds if k in RECURRENT_KINDS)
    state_per_layer = state.bytes_per_slot // max(n_recurrent, 1) * n_slots
    both = PARALLEL in c.layer_kinds  # Falcon-H1: every layer holds attention and Mamba-2
    weights = mlp + (attention + recurrent if both else max(attention, recurrent if n_recurrent else 0))
    return weights * dtype.itemsize + state_per_layer


def _mlp_weights(c: HybridConfig, layer: int, experts_on_host: bool) -> int:
    """Weights of layer `layer`'s MLP on its device: dense, or the router, the shared expert and (unless they
    live in host RAM) the routed experts."""
    m = c.moe
    if m is None or not c.is_moe_layer(layer):
        return 3 * c.hidden_size * c.intermediate_size
    routed = 0 if experts_on_host else m.n_experts * 3 * c.hidden_size * m.expert_size
    shared = 3 * c.hidden_size * m.shared_expert_size + c.hidden_size if m.shared_expert_size else 0
    if c.architecture == "granitemoehybrid":  # Granite's shared MLP is the layer's dense MLP, beside the experts
        shared += 3 * c.hidden_size * c.intermediate_size
    return routed + m.n_experts * c.hidden_size + shared
