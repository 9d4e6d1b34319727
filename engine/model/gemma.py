"""What Gemma 3 adds to the Llama family's description: its config.json and GGUF settings and its chat format.

The layer runs as its description says (engine/model/layers.py, from `ModelConfig.gemma`): norms scale by
(1 + w) (the loaders store 1 + w, as llama.cpp's converter does), the attention and MLP outputs have their own
norms, the MLP is GeGLU with the tanh GeLU, the embeddings are multiplied by sqrt(hidden), and the attention
scale is query_pre_attn_scalar^-1/2.
"""

from __future__ import annotations

from typing import Any

# transformers' Gemma3TextConfig defaults where config.json has no key.
HF_ROPE_THETA = 1_000_000.0
HF_HEAD_DIM = 256
_HF_LOCAL_ROPE_BASE = 10000.0
_HF_QUERY_PRE_ATTN_SCALAR = 256

# llama.cpp's gemma3 defaults where a file has no key: the local layers' RoPE base, and the 27B model (62
# layers) scaling queries by hidden / heads instead of the head width.
_GGUF_LOCAL_ROPE_BASE = 10000.0
_GGUF_27B_LAYERS = 62

# Gemma's turn format (used when a GGUF file carries no template, as llama.cpp's gemma3 files do): a system
# message opens the first user turn, the assistant's role is "model", every turn ends with <end_of_turn>.
GEMMA_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{%- set first = messages[0]['content'] + '\\n\\n' %}{%- set turns = messages[1:] %}"
    "{%- else %}{%- set first = '' %}{%- set turns = messages %}{%- endif %}"
    "{%- for message in turns %}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{- '<start_of_turn>' + role + '\\n' + (first if loop.first else '') + (message['content'] | trim)"
    " + '<end_of_turn>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)


def hf_gemma_problem(cfg: dict[str, Any]) -> str | None:
    """What in a gemma3 config.json names a variant this engine does not run (the setting named), or None."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        return f"gemma3: hidden_activation {act!r} is not supported (expected gelu_pytorch_tanh)"
    if cfg.get("attn_logit_softcapping") is not None:
        return "gemma3: attn_logit_softcapping is not supported (expected null)"
    if cfg.get("use_bidirectional_attention"):
        return "gemma3: use_bidirectional_attention is not supported (a causal model is expected)"
    return None


def hf_gemma_fields(cfg: dict[str, Any], rope_parameters: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields of a gemma3 config.json beyond the Llama family's: the local layers' RoPE base
    (transformers 5's per-layer-type `rope_parameters`, or 4.x's `rope_local_base_freq`) and the query scale."""
    if "full_attention" in rope_parameters:
        local = rope_parameters.get("sliding_attention") or {}
        local_theta = float(local.get("rope_theta", _HF_LOCAL_ROPE_BASE))
    else:
        local_theta = float(cfg.get("rope_local_base_freq", _HF_LOCAL_ROPE_BASE))
    return {"rope_local_theta": local_theta,
            "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar", _HF_QUERY_PRE_ATTN_SCALAR))}


def gguf_gemma_fields(arch: str, meta: dict[str, Any], n_layers: int, hidden: int, n_heads: int) -> dict[str, Any]:
    """The ModelConfig fields of a gemma3 GGUF beyond the Llama family's ({} for other architectures);
    ValueError for a setting this engine does not run."""
    if arch != "gemma3":
        return {}
    if meta.get(f"{arch}.attn_logit_softcapping"):
        raise ValueError(f"{arch}.attn_logit_softcapping is not supported")
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // n_heads)
    scalar = hidden // n_heads if n_layers == _GGUF_27B_LAYERS else head_dim
    cap = meta.get(f"{arch}.final_logit_softcapping")
    return {
        "rope_local_theta": float(meta.get(f"{arch}.rope.freq_base_swa") or _GGUF_LOCAL_ROPE_BASE),
        "query_pre_attn_scalar": float(scalar),
        "final_logit_softcapping": float(cap) if cap else None,
    }
