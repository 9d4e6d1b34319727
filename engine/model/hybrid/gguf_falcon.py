"""Falcon-H1 from GGUF (llama.cpp's `falcon-h1` architecture): its metadata keys and tensor names.

llama.cpp's converter folds every muP multiplier into the weights (ssm_in_multiplier x ssm_multipliers into
`ssm_in`'s rows, ssm_out into `ssm_out`, attention_in / key / attention_out into the q, k, v and o matrices, the MLP
multipliers into ffn_gate and ffn_down, embedding_multiplier into `token_embd` and lm_head_multiplier into
`output`), so the model runs with all of them 1. The Mamba-2 tensors are rewritten as for Granite-4.0-H (ssm_a =
-exp(A_log), [heads, 1] A and D, the conv squeezed, ssm_norm as [groups, inner / groups]); q/k are not permuted
(llama.cpp rotates them as transformers does). `ssm_norm` exists only for models with `mamba_rms_norm`, and
llama.cpp then normalises after the gate; the file does not say `mamba_norm_before_gate`, so that is what runs.
"""

from __future__ import annotations

from engine.errors import ModelLoadError
from engine.model.hybrid.config import PARALLEL, HybridConfig
from engine.model.hybrid.falcon_h1 import neutral_multipliers
from engine.model.hybrid.gguf_mamba import mamba_fields, metadata_key

ARCHITECTURE = "falcon-h1"
LAYER_NAMES = {
    "attn_norm.weight": "mixer_norm", "ffn_norm": "mlp_norm", "ffn_norm.weight": "mlp_norm",
    "attn_q.weight": "q", "attn_k.weight": "k", "attn_v.weight": "v", "attn_output.weight": "o",
    "ssm_in.weight": "ssm_in", "ssm_conv1d.weight": "conv", "ssm_conv1d.bias": "conv_bias", "ssm_dt.bias": "dt_bias",
    "ssm_a": "neg_a", "ssm_d": "d_skip", "ssm_norm.weight": "ssm_norm", "ssm_out.weight": "ssm_out",
    "ffn_gate.weight": "gate", "ffn_up.weight": "up", "ffn_down.weight": "down",
}
GLOBAL_NAMES = {"token_embd.weight": "embed", "output_norm.weight": "norm", "output.weight": "lm_head"}


def config(meta: dict, tensor_names: set[str], path: str, embed_rows: int) -> HybridConfig:
    arch = ARCHITECTURE

    key = metadata_key(meta, arch, path)
    n_layers, hidden, n_heads = int(key("block_count")), int(key("embedding_length")), int(key("attention.head_count"))
    kv = key("attention.head_count_kv")
    if isinstance(kv, list):
        if len(set(kv)) != 1:
            raise ModelLoadError(f"{path}: {arch}.attention.head_count_kv: every layer must have the same, got {kv}")
        kv = kv[0]
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // n_heads)
    return HybridConfig(
        architecture="falcon_h1",
        vocab_size=embed_rows,
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        layer_kinds=(PARALLEL,) * n_layers,
        n_heads=n_heads,
        n_kv_heads=int(kv),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(key("context_length", 8192)),
        tie_word_embeddings="output.weight" not in tensor_names,
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rotary_dim=head_dim,
        **mamba_fields(key, tensor_names, path),
        mamba_norm="gated" if any(n.endswith(".ssm_norm.weight") for n in tensor_names) else "gate_only",
        multipliers=neutral_multipliers(),
    )
