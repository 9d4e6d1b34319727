"""One description of a Llama-family model's layers, built once from its ModelConfig, read by every executor.

The executors (the eager `CausalLM.forward_chunks`, the lean CPU step `cpu_decode`, the native C step
`native_decode` + kernels/step.c, the CUDA graph step `graph_decode`) all run the same decoder layer; what
differs between families (Gemma's post-norms and GeGLU, OLMoE's full-width q/k norms, a sliding window, experts
instead of the MLP, scaled embeddings, soft-capped logits) is stated here once, per layer, instead of each
executor asking the config (`architecture == "gemma3"`, `query_pre_attn_scalar`, the shape of a norm weight)
in its own way. Which executor runs which of these features is the table in engine/model/executors.py.

What is folded into the weights at load is recorded but never applied by an executor: Gemma 3's (1 + w) norms
(the loaders store 1 + w, as llama.cpp's converter does) and GraniteMoE's embedding, attention, residual and
logits multipliers (moe_loading.fold_scales).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from engine.model.config import ModelConfig

QkNorm = Literal["none", "head", "full"]
Activation = Literal["silu", "gelu_tanh"]

# The features a layer description can use, by the name the executors' table (executors.py) and the log use.
FEATURES = (
    "sliding window",  # a layer attends only to the last `window` positions (sliding.py)
    "local rope",  # a sliding layer rotates with its own unscaled RoPE base (Gemma 3)
    "per-head q/k norms",  # RMSNorm of each q and k head over head_dim (Qwen3, Gemma 3)
    "full-width q/k norms",  # RMSNorm of q and of k over their full widths, before the head split (OLMoE)
    "attention bias",  # biases on q, k and v (Qwen2)
    "attention scale",  # a softmax scale other than 1/sqrt(head_dim) (Gemma 3's query_pre_attn_scalar)
    "partial or no rope",  # RoPE on the leading channels of a head only, or none (GLM-4.x MoE; hybrids: Qwen3.5)
    "latent attention",  # heads share one compressed latent, the K/V store keeps it (DeepSeek-V3, mla.py)
    "output gate",  # a sigmoid gate on the attention output, its rows interleaved with q's (hybrids: Qwen3.5)
    "post-norms",  # RMSNorm of the attention and of the MLP outputs before the residual (Gemma 3)
    "GeGLU",  # the MLP's gate through the tanh GeLU instead of SiLU (Gemma 3)
    "experts",  # a sparse expert block instead of the dense MLP (moe.py)
    "shared expert",  # an always-on expert behind a sigmoid gate beside the routed ones (Qwen2-MoE)
    "ungated shared expert",  # an always-on expert added without a gate (GLM-4.x MoE)
    "sigmoid routing",  # sigmoid scores, experts chosen by score + bias, optionally by groups (GLM-4.x MoE)
    "attention sinks",  # a learned logit per head joins each softmax's denominator (gpt-oss)
    "output bias",  # a bias on the attention's output projection (gpt-oss)
    "router bias",  # a bias on the router's logits (gpt-oss)
    "clamped SwiGLU",  # experts with biases and a clamped (up + 1) * gate * sigmoid(alpha * gate) (gpt-oss)
    "embedding scale",  # embeddings times sqrt(hidden) in the weights' dtype (Gemma 3)
    "soft-capped logits",  # logits -> cap * tanh(logits / cap)
    "value norm",  # an RMSNorm without a weight on each value head (Gemma 4)
    "layer scale",  # the layer's output times a scalar of its own (Gemma 4)
    "per-layer inputs",  # a per-layer embedding of the token through a gated residual after the MLP (Gemma 4)
    "shared K/V",  # a layer attends to an earlier layer's K/V and computes none (Gemma 4)
    "parallel experts",  # an expert block beside the dense MLP, its own router, norms and GeGLU experts (Gemma 4)
)


@dataclass(frozen=True, slots=True)
class NormSpec:
    """A layer's RMSNorms: before attention and before the MLP always, after each of them optionally."""

    eps: float
    post: bool  # the attention and MLP outputs are normalised before they join the residual (Gemma 3)
    stored_offset: bool  # the norm scales by (1 + w), stored as 1 + w by the loaders: no executor adds the 1


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """The rotary embedding of a layer's q and k."""

    theta: float
    scaling: dict[str, Any] | None  # ModelConfig.rope_scaling (None: plain RoPE)
    local: bool  # Gemma 3's sliding layers: their own base, unscaled (CausalLM.rotary_local)


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """A layer's self-attention."""

    window: int | None  # None: every earlier position; else the last `window` positions (sliding.py)
    rope: RopeSpec
    qk_norm: QkNorm  # none, per head over head_dim, or over q's and k's full widths before the head split
    scale: float | None  # the softmax scale; None: 1/sqrt(head_dim), each kernel's own default arithmetic
    bias: bool  # q, k and v have biases
    sinks: bool = False  # a learned logit per head joins the softmax's denominator, no value (gpt-oss)
    out_bias: bool = False  # the output projection has a bias (gpt-oss)
    rotary_dim: int | None = None  # leading channels of a head RoPE rotates; None: all of them, 0: no RoPE
    output_gate: bool = False  # q_proj also yields a sigmoid gate per output channel (hybrid/attention.py)
    latent: bool = False  # multi-head latent attention (ModelConfig.mla, engine/model/mla.py; its softmax scale
    # is MlaConfig.softmax_scale, over the latent's widths, never `scale`)
    value_norm: bool = False  # each value head is RMS-normalised, without a weight (Gemma 4)

    @property
    def kind(self) -> str:
        """"sliding" or "full"."""
        return "full" if self.window is None else "sliding"


@dataclass(frozen=True, slots=True)
class ExpertsSpec:
    """The sparse expert block that replaces a layer's dense MLP (engine/model/moe.py)."""

    n_experts: int
    top_k: int
    size: int  # intermediate size of one expert
    routing: str  # moe_config.ROUTINGS
    norm_topk_prob: bool
    shared_size: int  # the shared expert's intermediate size; 0 = none
    shared_gated: bool = True  # the shared expert's output times a sigmoid gate (Qwen2-MoE); False: added as it is
    router_bias: bool = False  # the router's logits have a bias (gpt-oss)
    clamped_swiglu: bool = False  # experts with biases and gpt-oss's clamped SwiGLU (moe_config.MoeConfig)


@dataclass(frozen=True, slots=True)
class MlpSpec:
    """A layer's feed-forward block: a gated MLP, or experts."""

    activation: Activation  # of the gate: SiLU (SwiGLU) or the tanh GeLU (GeGLU)
    size: int  # the dense MLP's intermediate size (ModelConfig.intermediate_size)
    experts: ExpertsSpec | None = None  # not None: the experts replace the dense MLP

    @property
    def kind(self) -> str:
        """"experts" or "dense"."""
        return "dense" if self.experts is None else "experts"


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """One decoder layer: x += [post_norm](attention(norm(x))); x += [post_norm](mlp(norm(x)))."""

    index: int
    norm: NormSpec
    attention: AttentionSpec
    mlp: MlpSpec
    scaled: bool = False  # the layer's output is multiplied by its own scalar (Gemma 4's layer_scalar)
    per_layer_input: int = 0  # the width of its per-layer input (Gemma 4's PLE; per_layer_inputs.py), 0: none
    kv_source: int | None = None  # the earlier layer whose K/V it attends to, computing none (Gemma 4); None: its own
    parallel_experts: bool = False  # an expert block beside the dense MLP (Gemma 4's, gemma4_experts.py)

    def features(self) -> frozenset[str]:
        """The FEATURES this layer uses."""
        a, m = self.attention, self.mlp
        used = {
            "sliding window": a.window is not None,
            "local rope": a.rope.local,
            "per-head q/k norms": a.qk_norm == "head",
            "full-width q/k norms": a.qk_norm == "full",
            "attention bias": a.bias,
            "attention scale": a.scale is not None,
            "partial or no rope": a.rotary_dim is not None,
            "latent attention": a.latent,
            "output gate": a.output_gate,
            "post-norms": self.norm.post,
            "GeGLU": m.activation == "gelu_tanh",
            "experts": m.experts is not None,
            "shared expert": m.experts is not None and m.experts.shared_size > 0 and m.experts.shared_gated,
            "ungated shared expert": m.experts is not None and m.experts.shared_size > 0 and not m.experts.shared_gated,
            "sigmoid routing": m.experts is not None and m.experts.routing == "sigmoid_bias",
            "value norm": a.value_norm,
            "layer scale": self.scaled,
            "per-layer inputs": self.per_layer_input > 0,
            "shared K/V": self.kv_source is not None,
            "parallel experts": self.parallel_experts,
            "attention sinks": a.sinks,
            "output bias": a.out_bias,
            "router bias": m.experts is not None and m.experts.router_bias,
            "clamped SwiGLU": m.experts is not None and m.experts.clamped_swiglu,
        }
        return frozenset(name for name, on in used.items() if on)


@dataclass(frozen=True, slots=True)
class ModelLayers:
    """The description of a whole model: its layers, and what happens before the first and after the last."""

    layers: tuple[LayerSpec, ...]
    final_norm_eps: float  # the norm before the output matrix
    embedding_scale: float | None  # embeddings times this, in the weights' dtype (Gemma 3: sqrt(hidden))
    final_softcap: float | None  # logits -> cap * tanh(logits / cap)
    folded_multipliers: bool  # GraniteMoE's scalars are in the weights (moe_loading.fold_scales)

    def features(self) -> frozenset[str]:
        """The FEATURES any part of the model uses."""
        used = {name for layer in self.layers for name in layer.features()}
        if self.embedding_scale is not None:
            used.add("embedding scale")
        if self.final_softcap is not None:
            used.add("soft-capped logits")
        return frozenset(used)

    @property
    def windows(self) -> tuple[int, ...]:
        """The distinct attention windows of the sliding layers (empty: full attention everywhere)."""
        return tuple(sorted({layer.attention.window for layer in self.layers if layer.attention.window is not None}))


def describe_layers(config: ModelConfig) -> ModelLayers:
    """The layer description of a model of `config` (the loader builds it once; CausalLM keeps it)."""
    c = config
    gemma, gemma4 = c.gemma, c.architecture == "gemma4"
    # OLMoE normalises q and k over their full widths; with one head that is the per-head norm.
    qk: QkNorm = "none" if not c.qk_norm else "full" if c.architecture == "olmoe" and c.n_heads > 1 else "head"
    scale = None if c.query_pre_attn_scalar is None else c.query_pre_attn_scalar**-0.5
    norm = NormSpec(eps=c.rms_norm_eps, post=gemma, stored_offset=c.norm_offset)
    gpt_oss = c.architecture == "gpt_oss"  # sinks, and a bias on the output projection too when on q, k and v
    layers = []
    for i in range(c.n_layers):
        window = c.layer_window(i)
        local = window is not None and c.rope_local_theta is not None
        rope = (RopeSpec(theta=c.rope_local_theta, scaling=None, local=True) if local and c.rope_local_theta is not None
                else RopeSpec(theta=c.rope_theta, scaling=c.rope_scaling, local=False))
        experts = None
        if c.moe is not None and c.is_moe_layer(i):
            m = c.moe
            experts = ExpertsSpec(n_experts=m.n_experts, top_k=m.top_k, size=m.expert_size, routing=m.routing,
                                  norm_topk_prob=m.norm_topk_prob, shared_size=m.shared_expert_size,
                                  shared_gated=m.shared_gated, router_bias=m.router_bias,
                                  clamped_swiglu=m.clamped_swiglu)
        layers.append(LayerSpec(
            index=i, norm=norm,
            attention=AttentionSpec(window=window, rope=rope, qk_norm=qk, scale=scale, bias=c.attention_bias,
                                    rotary_dim=c.rotary_dim, latent=c.mla is not None, value_norm=gemma4,
                                    sinks=gpt_oss, out_bias=gpt_oss and c.attention_bias),
            mlp=MlpSpec(activation="gelu_tanh" if gemma else "silu", size=c.mlp_size(i), experts=experts),
            scaled=gemma4, per_layer_input=c.per_layer_input, kv_source=None if i < c.kv_layers else c.kv_source(i),
            parallel_experts=any(c.parallel_experts),
        ))
    return ModelLayers(
        layers=tuple(layers),
        final_norm_eps=c.rms_norm_eps,
        embedding_scale=c.hidden_size**0.5 if gemma else None,
        final_softcap=c.final_logit_softcapping,
        folded_multipliers=c.moe is not None and c.architecture == "granitemoe",
    )
