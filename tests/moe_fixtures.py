"""Tiny random-weight mixture-of-experts models in HF folders, from transformers' own config classes.

`write_tiny_moe_model(root, "qwen3_moe")` writes a folder both transformers and the engine load, with the same
tokenizer files as tests/model_fixtures.py. Each family's tiny config exercises what sets it apart: Qwen3-MoE
a dense layer among expert layers and renormalised top-k, Qwen2-MoE the gated shared expert and q/k/v bias,
OLMoE full-width q/k norms, GraniteMoE its four multipliers with tied embeddings.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.model_fixtures import TINY_SIZES, tiny_vocab_size, write_tokenizer_files

MOE_ARCHS = ("qwen3_moe", "olmoe", "mixtral", "granitemoe", "qwen2_moe")

N_EXPERTS, TOP_K, EXPERT_SIZE = 8, 2, 32

_FAMILY = {
    "qwen3_moe": dict(num_experts=N_EXPERTS, moe_intermediate_size=EXPERT_SIZE, norm_topk_prob=True,
                      mlp_only_layers=[1], tie_word_embeddings=True),
    "qwen2_moe": dict(num_experts=N_EXPERTS, moe_intermediate_size=EXPERT_SIZE, norm_topk_prob=False,
                      shared_expert_intermediate_size=64, qkv_bias=True, tie_word_embeddings=False),
    "olmoe": dict(num_experts=N_EXPERTS, intermediate_size=EXPERT_SIZE, norm_topk_prob=False,
                  tie_word_embeddings=False),
    "mixtral": dict(num_local_experts=N_EXPERTS, intermediate_size=EXPERT_SIZE, sliding_window=None,
                    tie_word_embeddings=False),
    "granitemoe": dict(num_local_experts=N_EXPERTS, intermediate_size=EXPERT_SIZE, embedding_multiplier=3.0,
                       attention_multiplier=0.2, residual_multiplier=0.6, logits_scaling=2.5,
                       tie_word_embeddings=True),
}


def tiny_moe_config(arch: str, **overrides):
    """A transformers config object for a tiny MoE model of `arch`."""
    import transformers

    classes = {
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "qwen2_moe": transformers.Qwen2MoeConfig,
        "olmoe": transformers.OlmoeConfig,
        "mixtral": transformers.MixtralConfig,
        "granitemoe": transformers.GraniteMoeConfig,
    }
    if arch not in classes:
        raise ValueError(f"arch: expected one of {', '.join(MOE_ARCHS)}, got {arch!r}")
    kwargs = dict(TINY_SIZES)
    kwargs.update(
        vocab_size=tiny_vocab_size(),
        num_experts_per_tok=TOP_K,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        initializer_range=0.25,  # large enough that routing and greedy choices are not near-ties
        bos_token_id=None,
        eos_token_id=2,
        pad_token_id=0,
    )
    if arch != "olmoe":  # OLMoE's q/k norms span the full width, so its head_dim is hidden / heads
        kwargs["head_dim"] = 16
    kwargs.update(_FAMILY[arch])
    kwargs.update(overrides)
    return classes[arch](**kwargs)


def write_tiny_moe_model(root: str | os.PathLike, arch: str, *, name: str | None = None, seed: int = 0,
                         same_router_rows: bool = False, int4_grid: bool = False, **overrides) -> str:
    """Write a random-weight MoE model of `arch` under `root`; returns the folder. With `same_router_rows`
    every expert's router row is the same, so all experts tie for every token (routing ties). With `int4_grid`
    every matrix lies on a 4-bit grid per group of 32 (as a Q4_1 file's weights do), so 4-bit weights lose
    nothing and what differs from float is the kernel's bfloat16 activations."""
    import torch
    import transformers

    config = tiny_moe_config(arch, **overrides)
    folder = Path(root) / (name or f"tiny-{arch}")
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if "norm" in pname:  # non-trivial norm weights, so a missing or misplaced norm shows
                param.uniform_(0.5, 1.5)
            elif pname.endswith(".bias"):
                param.normal_(0.0, 0.5)
            elif same_router_rows and param.dim() == 2 and param.shape[0] == N_EXPERTS:
                param.copy_(param[:1].expand_as(param))
            elif int4_grid and param.dim() >= 2 and param.shape[-1] % 32 == 0:
                param.copy_(_on_int4_grid(param))
    transformers.utils.logging.disable_progress_bar()
    model.save_pretrained(folder)
    write_tokenizer_files(folder)
    return str(folder)


def _on_int4_grid(w):
    """`w` rounded to min + scale * q (q in 0..15) per group of 32 along its last dimension."""
    groups = w.reshape(*w.shape[:-1], -1, 32)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale = (high - low) / 15
    return (low + scale * ((groups - low) / scale).round()).reshape(w.shape)
