"""Tiny random-weight hybrid models (HF folders written by transformers' save_pretrained) for tests."""

from __future__ import annotations

import os
from pathlib import Path

from tests.model_fixtures import tiny_vocab_size, write_tokenizer_files

HYBRID_ARCHS = ("lfm2", "qwen3_5", "granitemoehybrid")


def tiny_hybrid_config(arch: str):
    """A transformers config for a tiny `arch` model: 4 layers, attention at layers 1 and 3."""
    import transformers

    common = dict(
        vocab_size=tiny_vocab_size(), hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.25, bos_token_id=None,
        eos_token_id=2, pad_token_id=0,
    )
    if arch == "lfm2":
        return transformers.Lfm2Config(
            **common, intermediate_size=96, block_multiple_of=16, conv_L_cache=3, norm_eps=1e-5,
            layer_types=["conv", "full_attention", "conv", "full_attention"], tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    if arch == "qwen3_5":
        return transformers.Qwen3_5TextConfig(
            # Smaller weights: with large activations the L2-normalised DeltaNet keys amplify float32 rounding
            # (transformers' own float32 forward then drifts ~1e-3 from a float64 one).
            **{**common, "initializer_range": 0.08}, intermediate_size=128, head_dim=16, rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        )
    if arch == "granitemoehybrid":  # dense (Granite-4.0-H-Micro-like), NoPE attention, non-trivial multipliers
        return transformers.GraniteMoeHybridConfig(
            **common, intermediate_size=128, shared_intermediate_size=128, num_local_experts=0,
            num_experts_per_tok=0, rms_norm_eps=1e-6, tie_word_embeddings=False, position_embedding_type="nope",
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
            mamba_chunk_size=32, mamba_conv_bias=True, embedding_multiplier=2.0, residual_multiplier=0.5,
            attention_multiplier=0.2, logits_scaling=1.5,
        )
    raise ValueError(f"arch: expected one of {', '.join(HYBRID_ARCHS)}, got {arch!r}")


def write_tiny_hybrid(tmp_path: str | os.PathLike, arch: str, *, seed: int = 0) -> str:
    """Write a random-weight `arch` hybrid under tmp_path (safetensors + tokenizer); returns the folder."""
    import torch
    import transformers

    config = tiny_hybrid_config(arch)
    folder = Path(tmp_path) / f"tiny-{arch}"
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # Non-trivial norm weights and biases, so a missing or misplaced one shows in parity tests.
        for name, param in model.named_parameters():
            if "norm" in name:
                # Qwen3.5 stores its RMSNorm weights (outside the DeltaNet) as w - 1.
                centred = arch == "qwen3_5" and "linear_attn.norm" not in name
                param.uniform_(-0.5, 0.5) if centred else param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.5)
    transformers.utils.logging.disable_progress_bar()
    model.save_pretrained(folder)
    write_tokenizer_files(folder)
    return str(folder)


def write_tiny_hybrid_gguf(tmp_path: str | os.PathLike, arch: str = "lfm2", *, quantize: bool = False) -> str:
    """Convert the tiny `arch` HF model to GGUF as llama.cpp's converter does (tensor names from gguf's own
    name map, the depthwise conv squeezed to 2-D, per-layer K/V head counts with 0 for conv layers); 2-D
    weights in Q8_0 when `quantize`. Returns the .gguf path; the HF folder sits beside it."""
    import json

    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    from tests.model_fixtures import CHATML_TEMPLATE, SPECIAL_TOKENS, tiny_tokenizer_json

    if arch != "lfm2":
        raise ValueError(f"arch: only lfm2 has a GGUF writer here, got {arch!r}")
    folder = write_tiny_hybrid(tmp_path, arch)
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    from engine.model.hybrid.lfm2 import mlp_size

    n_layers = cfg["num_hidden_layers"]
    path = Path(tmp_path) / f"tiny-{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), "lfm2")
    writer.add_block_count(n_layers)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(mlp_size(cfg))
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv([cfg["num_key_value_heads"] if t != "conv" else 0 for t in cfg["layer_types"]])
    writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_shortconv_l_cache(cfg["conv_L_cache"])

    spec = json.loads(tiny_tokenizer_json())
    vocab = {**spec["model"]["vocab"], **{t["content"]: t["id"] for t in spec["added_tokens"]}}
    tokens = [tok for tok, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LFM2, n_layers)
    for name, w in load_file(os.path.join(folder, "model.safetensors")).items():
        out = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert out is not None, f"no GGUF name for {name}"
        w = w.astype(np.float32)
        if ".conv.conv." in name:
            w = w.squeeze(1)
        if quantize and w.ndim == 2 and w.shape[1] % 32 == 0:
            q = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(out, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(out, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)
