"""What step.c and experts.c read: ctypes mirrors of their structs, checked field for field against the compiled
library (`layout_mismatch`, tests/test_native_kernels.py), and the codes and weight formats they take.

The structs are filled from the layer description (engine/model/layers.py) by native_decode.NativeDecode; whether
step.c runs a model at all is executors.native_step_declines.
"""

from __future__ import annotations

import ctypes

import torch

from engine.model import kernels
from engine.model.int4 import Int4Weight
from engine.model.layers import Activation, ModelLayers

KV_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # step.c's KV_* codes
ACTIVATIONS: dict[Activation, int] = {"silu": 0, "gelu_tanh": 1}  # step.c's activation codes
ROUTINGS = {("softmax_topk", False): 0, ("softmax_topk", True): 1, ("topk_softmax", False): 2,
            ("topk_softmax", True): 2, ("sigmoid_bias", False): 3, ("sigmoid_bias", True): 3}
# experts.h's routings by (MoeConfig.routing, norm_topk_prob); SIGMOID_BIAS reads norm_topk itself
MAX_GROUPS = 64  # experts.c's


class StepExperts(ctypes.Structure):
    """experts.h's StepExperts, field for field."""

    _fields_ = [*((name, ctypes.c_int64) for name in ("n_experts", "top_k", "inter", "shared_inter", "routing")),
                ("router", ctypes.c_void_p), ("gate_up", ctypes.POINTER(ctypes.c_void_p)),
                ("down", ctypes.POINTER(ctypes.c_void_p)), ("shared_gate_up", ctypes.c_void_p),
                ("shared_down", ctypes.c_void_p), ("kinds", ctypes.c_int64 * 4), ("router_bias", ctypes.c_void_p),
                ("gate_up_bias", ctypes.c_void_p), ("down_bias", ctypes.c_void_p), ("swiglu_limit", ctypes.c_double),
                ("swiglu_alpha", ctypes.c_double), ("expert_bias", ctypes.c_void_p), ("norm_eps", ctypes.c_double),
                ("routed_scaling", ctypes.c_double),
                *((name, ctypes.c_int64) for name in ("norm_topk", "n_group", "topk_group", "shared_gated"))]


class StepLayer(ctypes.Structure):
    """step.c's StepLayer, field for field."""

    _fields_ = [*((name, ctypes.c_void_p) for name in (
        "attn_norm", "mlp_norm", "wqkv", "bqkv", "wo", "w_gate_up", "w_down", "qk_norm", "post_attn_norm",
        "post_mlp_norm", "k_cache", "v_cache")), ("window", ctypes.c_int64), ("local", ctypes.c_int64),
        ("kinds", ctypes.c_int64 * 4), ("experts", ctypes.POINTER(StepExperts)), ("sinks", ctypes.c_void_p),
        ("bo", ctypes.c_void_p)]


class StepModel(ctypes.Structure):
    """step.c's StepModel, field for field."""

    _fields_ = [*((name, ctypes.c_int64) for name in (
        "n_layers", "hidden", "inter", "n_heads", "n_kv_heads", "head_dim", "ctx", "vocab", "kv_dtype", "head_kind",
        "activation")),
        ("eps", ctypes.c_double), ("scale", ctypes.c_double), ("layers", ctypes.POINTER(StepLayer)),
        ("norm", ctypes.c_void_p), ("head", ctypes.c_void_p), ("rotary_dim", ctypes.c_int64)]


MIRRORS = {"StepModel": StepModel, "StepLayer": StepLayer, "StepExperts": StepExperts}


def layout_mismatch(lib: kernels.Library) -> str | None:
    """How step.c's structs as this library compiled them (its step_layout table) differ from the ctypes mirrors
    above, or None when every size and field offset agrees: a field added on one side only would otherwise be
    read as another field."""
    ours: dict[tuple[str, str], tuple[int, int]] = {}
    for name, mirror in MIRRORS.items():
        ours[name, ""] = (0, ctypes.sizeof(mirror))
        for field, *_ in mirror._fields_:
            described = getattr(mirror, field)
            ours[name, field] = (described.offset, described.size)
    compiled = lib.layout()
    differ = sorted(key for key in ours.keys() | compiled.keys() if ours.get(key) != compiled.get(key))
    if not differ:
        return None
    names = ", ".join(f"{t}.{f}" if f else f"sizeof({t})" for t, f in differ)
    first = "; ".join(f"{t}.{f or 'size'} {ours.get((t, f))} here, {compiled.get((t, f))} in C" for t, f in differ[:3])
    return f"step.c's structs differ from native_decode.py's in {names} ((offset, size): {first})"


def model_wide(description: ModelLayers, head_dim: int) -> tuple[int, float, float]:
    """StepModel's (activation, eps, scale) from the description: step.c takes one of each for every layer,
    so a model whose layers differ in them is refused here (no family this engine runs has such layers)."""
    activations = {layer.mlp.activation for layer in description.layers}
    eps = {layer.norm.eps for layer in description.layers} | {description.final_norm_eps}
    scales = {layer.attention.scale for layer in description.layers}
    assert len(activations) == len(eps) == len(scales) == 1, "step.c takes one activation, eps and scale per model"
    scale = scales.pop()
    return ACTIVATIONS[activations.pop()], eps.pop(), head_dim**-0.5 if scale is None else scale


def is_native(w: object) -> bool:
    """Whether step.c multiplies this weight as it is: the native 4-bit blocks or a file's rows."""
    return isinstance(w, kernels.RowsWeight) or (isinstance(w, Int4Weight) and w.kernel == "blocks")


def kind(w: object) -> int:
    """blocks.h's ROWS_* for a native weight (0: Int4Weight's Q4 runs)."""
    code = w.rows_code if isinstance(w, kernels.RowsWeight) else 0
    assert code >= 0, type(w)
    return code
