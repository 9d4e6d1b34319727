"""One Llama-family transformer block's weights, as its layer description (engine/model/layers.py) says they are
used: fused q/k/v and gate/up projections, the norms, and the optional parts other families add (q/k norms,
Gemma's post-norms and per-layer inputs, gpt-oss's sinks and output bias, the expert block, latent attention).
The forward that runs it is engine/model/llama.py's `CausalLM._layer`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.model.config import ModelConfig
from engine.model.int4 import Int4Weight
from engine.model.kquant_weight import KQuantWeight
from engine.model.layers import LayerSpec
from engine.model.q8_weight import Q8Weight

if TYPE_CHECKING:
    from engine.model.gemma4_experts import Gemma4Experts
    from engine.model.mla import MlaAttention
    from engine.model.moe import SparseMoe


class DecoderLayer(torch.nn.Module):
    """One transformer block with fused q/k/v and gate/up projections, as `spec` describes it (layers.py)."""

    # The buffers registered in __init__, typed (nn.Module's attribute lookup is typed Tensor | Module);
    # int4 replaces the projection weights by Int4Weight ones (build, int4.quantize_model), or by Q8Weight ones
    # where the file holds them with more bits (engine/model/q8_weight.py).
    attn_norm: torch.Tensor
    wqkv: torch.Tensor | Int4Weight | Q8Weight | KQuantWeight
    bqkv: torch.Tensor | None
    wo: torch.Tensor | Int4Weight | Q8Weight | KQuantWeight
    mlp_norm: torch.Tensor
    w_gate_up: torch.Tensor | Int4Weight | Q8Weight | KQuantWeight | None
    w_down: torch.Tensor | Int4Weight | Q8Weight | KQuantWeight | None
    q_norm_full: torch.Tensor | None
    k_norm_full: torch.Tensor | None
    qk_norm: torch.Tensor | None
    post_attn_norm: torch.Tensor | None
    post_mlp_norm: torch.Tensor | None
    layer_scalar: torch.Tensor | None
    ple_gate: torch.Tensor | None
    ple_proj: torch.Tensor | None
    ple_norm: torch.Tensor | None
    sinks: torch.Tensor | None
    bo: torch.Tensor | None

    def __init__(
        self,
        config: ModelConfig,
        spec: LayerSpec,
        *,
        attn_norm: torch.Tensor,
        wqkv: torch.Tensor,
        bqkv: torch.Tensor | None,
        wo: torch.Tensor,
        mlp_norm: torch.Tensor,
        w_gate_up: torch.Tensor | None,
        w_down: torch.Tensor | None,
        q_norm: torch.Tensor | None = None,
        k_norm: torch.Tensor | None = None,
        moe: SparseMoe | None = None,
        post_attn_norm: torch.Tensor | None = None,
        post_mlp_norm: torch.Tensor | None = None,
        mla: MlaAttention | None = None,
        layer_scalar: torch.Tensor | None = None,
        per_layer: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        experts: Gemma4Experts | None = None,
        sinks: torch.Tensor | None = None,
        bo: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        c = config
        kv_heads, head_dim = c.layer_heads(spec.index)  # Gemma 4's global layers may have their own
        q_rows, kv_rows = c.n_heads * head_dim, kv_heads * head_dim
        own_kv = spec.kv_source is None  # Gemma 4's K/V-sharing layers project q alone
        first_rows, o_cols = q_rows + 2 * kv_rows * own_kv, q_rows
        assert (mla is not None) == spec.attention.latent, f"layer {spec.index}: latent attention as described"
        if c.mla is not None:  # wqkv: the query's first projection, then kv_a (engine/model/mla.py)
            first_rows, o_cols = c.mla.q_rows(c.n_heads) + c.mla.latent_width, c.n_heads * c.mla.v_head_dim
        assert wqkv.shape == (first_rows, c.hidden_size), ("wqkv", tuple(wqkv.shape))
        assert wo.shape == (c.hidden_size, o_cols), ("wo", tuple(wo.shape))
        assert (moe is not None) == (spec.mlp.experts is not None), f"layer {spec.index}: {spec.mlp.kind} expected"
        if moe is None:
            assert w_gate_up is not None and w_down is not None, "a dense layer needs w_gate_up and w_down"
            assert w_gate_up.shape == (2 * spec.mlp.size, c.hidden_size), ("w_gate_up", tuple(w_gate_up.shape))
            assert w_down.shape == (c.hidden_size, spec.mlp.size), ("w_down", tuple(w_down.shape))
        else:  # a sparse expert block (engine/model/moe.py) instead of the dense MLP
            assert w_gate_up is None and w_down is None, "a layer has either a dense MLP or experts"
        self.moe = moe
        self.mla = mla
        self.config = config
        self.spec = spec
        self.register_buffer("attn_norm", attn_norm, persistent=False)
        self.register_buffer("wqkv", wqkv, persistent=False)
        self.register_buffer("bqkv", bqkv, persistent=False)
        self.register_buffer("wo", wo, persistent=False)
        self.register_buffer("mlp_norm", mlp_norm, persistent=False)
        self.register_buffer("w_gate_up", w_gate_up, persistent=False)
        self.register_buffer("w_down", w_down, persistent=False)
        qk_norm = None
        kind = spec.attention.qk_norm
        assert (q_norm is not None) == (k_norm is not None or not own_kv) == (kind != "none"), f"q/k norms: {kind}"
        # OLMoE normalises q and k over their full widths (one weight per row of q, of k) before the head split.
        full = kind == "full"
        self.register_buffer("q_norm_full", q_norm if full else None, persistent=False)
        self.register_buffer("k_norm_full", k_norm if full else None, persistent=False)
        if full:
            assert q_norm is not None and q_norm.shape == (q_rows,), "full-width q norm: one weight per row of q"
            assert k_norm is not None and k_norm.shape == (kv_rows,), "full-width q norm needs a full-width k norm"
        elif q_norm is not None:
            # One weight row per q head then per k head, so both norms run as one op on the q|k view.
            qk_norm = q_norm.expand(c.n_heads, -1) if k_norm is None else torch.cat(
                (q_norm.expand(c.n_heads, -1), k_norm.expand(kv_heads, -1)))
        self.register_buffer("qk_norm", qk_norm, persistent=False)
        # Gemma: the attention output and the MLP output are normalised before they join the residual.
        assert (post_attn_norm is not None) == (post_mlp_norm is not None) == spec.norm.post, "post-norms: as described"
        self.register_buffer("post_attn_norm", post_attn_norm, persistent=False)
        self.register_buffer("post_mlp_norm", post_mlp_norm, persistent=False)
        # Gemma 4: the layer's output scalar, and the gate, projection and norm of its per-layer input.
        assert (layer_scalar is not None) == spec.scaled and (per_layer is not None) == (spec.per_layer_input > 0)
        self.register_buffer("layer_scalar", layer_scalar, persistent=False)
        ple_gate, ple_proj, ple_norm = per_layer or (None, None, None)
        if ple_gate is not None:
            assert ple_gate.shape == (spec.per_layer_input, c.hidden_size), ("ple_gate", tuple(ple_gate.shape))
        self.register_buffer("ple_gate", ple_gate, persistent=False)
        self.register_buffer("ple_proj", ple_proj, persistent=False)
        self.register_buffer("ple_norm", ple_norm, persistent=False)
        assert (experts is not None) == spec.parallel_experts, f"layer {spec.index}: the expert block as described"
        self.experts = experts  # Gemma 4's expert block beside the dense MLP
        # gpt-oss: a learned logit per head in each softmax's denominator, and a bias on the output projection.
        assert (sinks is not None) == spec.attention.sinks, "attention sinks: as described"
        assert sinks is None or sinks.shape == (c.n_heads,), ("sinks", tuple(sinks.shape))
        assert (bo is not None) == spec.attention.out_bias, "output bias: as described"
        assert bo is None or bo.shape == (c.hidden_size,), ("bo", tuple(bo.shape))
        self.register_buffer("sinks", sinks, persistent=False)
        self.register_buffer("bo", bo, persistent=False)
