"""Tiny random-weight multi-head latent attention models (DeepSeek-V3, GLM-4.7-Flash) in HF folders, from
transformers' own config classes, with the tokenizer of tests/model_fixtures.py.

Each tiny config keeps what sets the family apart: latent widths unlike the head widths, RoPE in interleaved
pairs, a dense layer before the expert layers, grouped sigmoid routing with a correction bias, a shared expert
and the routed scaling; `q_lora_rank=None` gives the direct q_proj.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.model_fixtures import tiny_vocab_size, write_tokenizer_files

MLA_ARCHS = ("deepseek_v3", "glm4_moe_lite")

_COMMON = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
               n_shared_experts=1, kv_lora_rank=24, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
               v_head_dim=12, max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.25,
               tie_word_embeddings=False, bos_token_id=None, eos_token_id=2, pad_token_id=0)
_FAMILY = {
    "deepseek_v3": dict(first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                        rope_interleave=True),
    "glm4_moe_lite": dict(mlp_layer_types=["dense", "sparse", "sparse"], n_group=1, topk_group=1,
                          routed_scaling_factor=1.8, rope_interleave=True),
}


def tiny_mla_config(arch: str, **overrides):
    """A transformers config object for a tiny latent-attention model of `arch`."""
    import transformers

    classes = {"deepseek_v3": transformers.DeepseekV3Config, "glm4_moe_lite": transformers.Glm4MoeLiteConfig}
    if arch not in classes:
        raise ValueError(f"arch: expected one of {', '.join(classes)}, got {arch!r}")
    kwargs = {**_COMMON, "vocab_size": tiny_vocab_size(), **_FAMILY[arch], **overrides}
    kwargs.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0})
    if arch == "deepseek_v3":
        kwargs.setdefault("num_mtp_layers", 0)
    return classes[arch](**kwargs)


def write_tiny_mla_model(root: str | os.PathLike, arch: str, *, seed: int = 0, **overrides) -> str:
    """Write a random-weight latent-attention model of `arch` under `root`; returns the folder."""
    import torch
    import transformers

    config = tiny_mla_config(arch, **overrides)
    folder = Path(root) / f"tiny-{arch}"
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if "norm" in pname:  # non-trivial norm weights, so a missing or misplaced norm shows
                param.uniform_(0.5, 1.5)
        for bname, buf in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):  # a bias that changes which experts are chosen
                buf.normal_(0.0, 0.3)
    transformers.utils.logging.disable_progress_bar()
    model.save_pretrained(folder)
    write_tokenizer_files(folder)
    return str(folder)
