"""Which executor runs which layer features, and the one gate per executor that says why it declines a model.

Four executors run a Llama-family model's decoder layer (engine/model/layers.py describes the layer once):

- the eager forward, `CausalLM.forward_chunks` (llama.py): every feature of a Llama-family layer, every step; the
  others hand it what they decline;
- the lean CPU step (cpu_decode.py): forward_chunks' own kernels for steps of one-token rows, less Python;
- the native step (native_decode.py over kernels/step.c and experts.c): the CPU decode step as one C call;
- the CUDA graph step (graph_decode.py): a decode step captured once and replayed.

`DECLINED` is the table: per executor, the layer features it does not run, grouped under the reason the log
prints, in the order its gate checks them. Each gate (`cpu_step_declines`, `native_step_declines`,
`graph_step_declines`) adds what is not a layer feature (devices, dtype, weight formats, the kernels'
limits) before or after, and returns the first reason or None; `engine.model.graph_decode.configure` picks the
executor and logs the reason of those it passed over. docs/DETAILS.md prints the table (`feature_table`).
"""

from __future__ import annotations

from typing import cast

import torch

from engine.model import kernels
from engine.model.decoder_layer import DecoderLayer
from engine.model.gpu_weights import CudaInt4Weight
from engine.model.int4 import Int4Weight
from engine.model.layers import FEATURES, ModelLayers
from engine.model.llama import CausalLM
from engine.model.moe import SparseMoe
from engine.model.native_layout import MAX_GROUPS, ROUTINGS, is_native, layout_mismatch

EAGER, CPU_STEP, NATIVE_STEP, GRAPH_STEP = "eager forward", "lean CPU step", "native step", "CUDA graph step"
EXECUTORS = (EAGER, CPU_STEP, NATIVE_STEP, GRAPH_STEP)

# The hybrids' attention (hybrid/attention.py, its own executor) runs these; no Llama-family config has them.
HYBRID_ONLY = ((frozenset({"output gate"}), "hybrid attention features"),)
# GLM-4.x MoE's partial RoPE: the eager forward, the native step (step.c's rotary_dim) and the graph step (through
# the eager `qkv`) run it; the lean CPU step rotates whole heads with its own code.
PARTIAL_ROPE = (frozenset({"partial or no rope"}), "partial RoPE")
# DeepSeek-V3's latent attention: the eager forward and the graph step (MlaAttention.decode_rows) read the latent
# rows; the CPU steps' kernels read per-head K/V rows (engine/model/mla.py).
LATENT = (frozenset({"latent attention"}), "latent attention")
# Gemma 4's value norm, layer scalar and per-layer inputs: only the eager forward runs them (step.c's layer,
# the lean step's and the captured one's have no place for a second embedding or a third residual).
GEMMA4 = (frozenset({"value norm", "layer scale", "per-layer inputs", "shared K/V", "parallel experts"}),
          "Gemma 4 layers")
# gpt-oss's layer: the eager forward and the native step (step.c's sink term and output bias, experts.c's biases
# and clamp) run it; the lean CPU step's and the graph step's attention has no sinks, and the grouped GEMMs no
# expert biases.
GPT_OSS = (frozenset({"attention sinks", "output bias", "router bias", "clamped SwiGLU"}),
           "attention sinks, output bias, router bias or clamped SwiGLU experts (gpt-oss layers)")
DECLINED: dict[str, tuple[tuple[frozenset[str], str], ...]] = {
    EAGER: HYBRID_ONLY,
    CPU_STEP: (
        *HYBRID_ONLY,
        LATENT,
        PARTIAL_ROPE,
        GEMMA4,
        GPT_OSS,
        (frozenset({"post-norms", "GeGLU", "local rope"}), "Gemma layers"),
        (frozenset({"experts", "shared expert", "ungated shared expert", "sigmoid routing", "full-width q/k norms"}),
         "experts or full-width q/k norms"),
        (frozenset({"soft-capped logits", "embedding scale"}), "soft-capped logits or scaled embeddings"),
    ),
    NATIVE_STEP: (
        *HYBRID_ONLY,
        LATENT,
        GEMMA4,
        (frozenset({"full-width q/k norms"}), "full-width q/k norms"),
        (frozenset({"soft-capped logits"}), "soft-capped logits"),
    ),
    # The captured step attends every row up to its length bucket with the default scale, and has no post-norms,
    # GeGLU, embedding scale or soft cap: those models decode eagerly (still one GEMM per projection).
    GRAPH_STEP: (
        *HYBRID_ONLY,
        GEMMA4,
        GPT_OSS,
        (frozenset({"sliding window"}), "sliding-window layers"),
        (frozenset({"post-norms", "GeGLU", "local rope", "embedding scale", "attention scale"}), "Gemma layers"),
        (frozenset({"soft-capped logits"}), "soft-capped logits"),
    ),
}
# Features an executor runs only under conditions its gate checks on the weights, not on the description.
CONDITIONS = {
    (NATIVE_STEP, "experts"): "in native 4-bit blocks, top-k <= 64",
    (NATIVE_STEP, "shared expert"): "in native 4- or 8-bit blocks",
    (NATIVE_STEP, "ungated shared expert"): "in native 4- or 8-bit blocks",
    (NATIVE_STEP, "sigmoid routing"): f"groups of 2 or more experts, at most {MAX_GROUPS} groups",
    (GRAPH_STEP, "experts"): "grouped GEMMs: bfloat16 on sm90/sm100, not --deterministic",
    (GRAPH_STEP, "shared expert"): "grouped GEMMs",
    (GRAPH_STEP, "ungated shared expert"): "grouped GEMMs",
    (GRAPH_STEP, "sigmoid routing"): "grouped GEMMs",
}


def runs(executor: str) -> frozenset[str]:
    """The layer features `executor` runs."""
    declined = {name for group, _ in DECLINED[executor] for name in group}
    return frozenset(FEATURES) - declined


def layer_declines(executor: str, description: ModelLayers) -> str | None:
    """The reason `executor` does not run a model of this description's layers, or None when it runs them all."""
    used = description.features()
    return next((reason for group, reason in DECLINED[executor] if used & group), None)


def feature_table() -> str:
    """The DECLINED table as markdown, one row per feature (docs/DETAILS.md holds a copy; a test compares them)."""
    rows = ["| layer feature | " + " | ".join(EXECUTORS) + " |", "|---" * (len(EXECUTORS) + 1) + "|"]
    for feature in FEATURES:
        cells = []
        for executor in EXECUTORS:
            cell = "yes" if feature in runs(executor) else "no"
            condition = CONDITIONS.get((executor, feature))
            cells.append(f"{cell}, if {condition}" if condition and cell == "yes" else cell)
        rows.append(f"| {feature} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _one_cpu_float32(model: CausalLM) -> str | None:
    if len({d for d, _, _ in model.stages}) != 1 or model.stages[0][0].type != "cpu":
        return "not on one CPU device"
    if model.dtype != torch.float32:
        return "compute dtype is not float32"
    return None


def cpu_step_declines(model: CausalLM) -> str | None:
    """Why the lean CPU step (cpu_decode.py) does not take this model's decode steps (None: it does)."""
    return _one_cpu_float32(model) or layer_declines(CPU_STEP, model.description)


def native_step_declines(model: CausalLM) -> str | None:
    """Why this model's decode steps do not run in step.c (native_decode.py) (None: they do)."""
    c = model.config
    layers = cast(list[DecoderLayer], list(model.layers))
    reason = _one_cpu_float32(model) or layer_declines(NATIVE_STEP, model.description)
    if reason:
        return reason
    lib = kernels.library()
    if lib is None:
        return f"no native kernels ({kernels.unavailable_reason()})"
    if mismatch := layout_mismatch(lib):
        return mismatch
    if not all(is_native(w) for layer in layers for w in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)
               if layer.moe is None or w is not None):
        return "projections not in the native 4-bit blocks"
    experts = next((why for layer in layers if layer.moe is not None and (why := _native_experts_decline(layer.moe))),
                   None)
    if experts:
        return experts
    if not is_native(model.lm_head):
        return "output matrix not in native 4- or 8-bit blocks"
    if c.head_dim % 8 or c.head_dim > 512 or c.n_heads % c.n_kv_heads or c.n_heads // c.n_kv_heads * c.head_dim > 4096:
        return f"head shape {c.n_heads}x{c.head_dim} over {c.n_kv_heads} K/V heads"  # step.c's MAX_* limits
    return None


def _native_experts_decline(moe: SparseMoe) -> str | None:
    """Why experts.c cannot run this expert block (None: it can)."""
    c = moe.config
    if (c.routing, c.norm_topk_prob) not in ROUTINGS:
        return f"{c.routing} routing (not one of experts.h's)"
    if c.activation != "silu":
        return f"{c.activation} experts (experts.c runs SwiGLU ones)"
    stacks = (moe.gate_up, moe.down)
    if any(isinstance(w, torch.Tensor) or not all(is_native(x) and type(x) is type(w[0]) for x in w) for w in stacks):
        return "experts not in the native 4-bit blocks"
    shared = (moe.shared_gate_up, moe.shared_down)
    if c.routing == "sigmoid_bias" and not (c.n_experts % c.n_group == 0 and c.n_experts // c.n_group >= 2
                                            and c.n_group <= MAX_GROUPS):
        return f"{c.n_group} expert groups of {c.n_experts} experts (experts.c ranks groups of 2 or more, at most {MAX_GROUPS})"
    if c.shared_expert_size and not all(is_native(w) for w in shared):
        return "shared expert not in native 4- or 8-bit blocks"
    if c.top_k > 64 or c.expert_size % 32 or c.shared_expert_size % 32:
        return f"experts of {c.expert_size} with top {c.top_k}"  # experts.c's limits
    if moe.router.dtype != torch.float32 or moe.router.device.type != "cpu":
        return "router not float32 on the CPU"
    return None


def graph_step_declines(model: CausalLM) -> str | None:
    """Why this model's decode cannot be captured in CUDA graphs (graph_decode.py) (None: it can)."""
    devices = {d for d, _, _ in model.stages}
    if len(devices) != 1:
        return "layers on several devices"
    if next(iter(devices)).type != "cuda":
        return "not on a CUDA device"
    layers = cast(list[DecoderLayer], list(model.layers))
    experts = [layer.moe for layer in layers if layer.moe is not None]
    if any(not moe.grouped_ready for moe in experts):
        # The per-expert loop reads each expert's row count back to the host (engine/model/moe.py).
        return "mixture-of-experts layers without grouped GEMMs (experts in host RAM, not bfloat16, or no sm90 kernel)"
    if experts and model.batch_invariant:
        return "mixture-of-experts layers with batch-invariant kernels (the per-expert loop)"
    weights = [model.lm_head] + [w for layer in layers for w in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)]
    if any(isinstance(w, Int4Weight) and not isinstance(w, CudaInt4Weight) for w in weights):
        return "CPU 4-bit weights"
    return layer_declines(GRAPH_STEP, model.description)
