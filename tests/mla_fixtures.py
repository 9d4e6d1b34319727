"""Tiny random-weight multi-head latent attention models (DeepSeek-V3, GLM-4.7-Flash) in HF folders, from
transformers' own config classes, with the tokenizer of tests/model_fixtures.py.

Each tiny config keeps what sets the family apart: latent widths unlike the head widths, RoPE in interleaved
pairs, a dense layer before the expert layers, grouped sigmoid routing with a correction bias, a shared expert
and the routed scaling; `q_lora_rank=None` gives the direct q_proj.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.model_fixtures import on_int4_grid, tiny_vocab_size, write_tokenizer_files

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


def write_tiny_mla_model(root: str | os.PathLike, arch: str, *, seed: int = 0, int4_grid: bool = False,
                         mtp: bool = False, **overrides) -> str:
    """Write a random-weight latent-attention model of `arch` under `root`; returns the folder. With `int4_grid`
    every matrix lies on a 4-bit grid per group of 32 (tests/moe_fixtures.py), so 4-bit weights lose nothing.
    With `mtp` the checkpoint carries one next-token (MTP) layer (`num_nextn_predict_layers` 1), as released."""
    import torch
    import transformers

    from tests.moe_fixtures import add_mtp_layers

    if mtp:
        overrides["num_mtp_layers" if arch == "deepseek_v3" else "num_nextn_predict_layers"] = 1
    config = tiny_mla_config(arch, **overrides)
    folder = Path(root) / f"tiny-{arch}"
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if "norm" in pname:  # non-trivial norm weights, so a missing or misplaced norm shows
                param.uniform_(0.5, 1.5)
            elif int4_grid and param.dim() >= 2 and param.shape[-1] % 32 == 0:
                param.copy_(on_int4_grid(param))
        for bname, buf in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):  # a bias that changes which experts are chosen
                buf.normal_(0.0, 0.3)
    transformers.utils.logging.disable_progress_bar()
    model.save_pretrained(folder)
    if mtp:
        add_mtp_layers(folder, config)
    write_tokenizer_files(folder)
    return str(folder)


# HF tensor names -> llama.cpp's deepseek2 names (conversion/deepseek.py's DeepseekV2Model through gguf-py's map)
_GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight", "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
    # a next-token (MTP) layer's own tensors (llama.cpp's NEXTN names)
    "eh_proj.weight": "nextn.eh_proj.weight", "enorm.weight": "nextn.enorm.weight",
    "hnorm.weight": "nextn.hnorm.weight", "shared_head.norm.weight": "nextn.shared_head_norm.weight",
}


def write_tiny_mla_gguf(root: str | os.PathLike, arch: str, *, split_kv_b: bool = True, quantize: bool = False,
                        seed: int = 0, mtp: bool = False, **overrides) -> str:
    """Convert a tiny latent-attention HF model to a GGUF as llama.cpp's converter writes it (arch `deepseek2`,
    MLA as one K/V head of kv_lora_rank + rope values, experts stacked, RoPE rows left interleaved): kv_b_proj
    split into attn_k_b (each head's k part transposed) and attn_v_b, or with `split_kv_b` false as one
    attn_kv_b, as older converters wrote it. The expert gating function is written as sigmoid, as DeepSeek-V3's
    own config.json (`scoring_func`) makes the converter write it. With `quantize` every matrix whose rows are
    whole blocks is Q8_0. With `mtp` the model's next-token layer follows as `blk.<n_layers>` (block_count counts
    it, `nextn_predict_layers` 1). Returns the .gguf path; the HF folder sits beside it."""
    import json
    import re

    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    from tests.model_fixtures import add_tiny_tokenizer

    folder = write_tiny_mla_model(root, arch, seed=seed, mtp=mtp, **overrides)
    cfg = json.loads((Path(folder) / "config.json").read_text())
    heads, rank, rope = cfg["num_attention_heads"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    nope, v_dim = cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    path = Path(root) / f"tiny-{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), "deepseek2")
    writer.add_block_count(cfg["num_hidden_layers"] + int(mtp))
    if mtp:
        writer.add_nextn_predict_layers(1)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(1)
    writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    dense = [i for i, kind in enumerate(cfg.get("mlp_layer_types") or []) if kind == "dense"]
    writer.add_leading_dense_block_count(cfg.get("first_k_dense_replace", len(dense)))
    if cfg.get("q_lora_rank") is not None:
        writer.add_q_lora_rank(cfg["q_lora_rank"])
    writer.add_kv_lora_rank(rank)
    writer.add_key_length(rank + rope)
    writer.add_value_length(rank)
    writer.add_key_length_mla(nope + rope)
    writer.add_value_length_mla(v_dim)
    writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    writer.add_expert_count(cfg["n_routed_experts"])
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    writer.add_expert_shared_count(cfg["n_shared_experts"])
    writer.add_expert_weights_scale(cfg["routed_scaling_factor"])
    writer.add_expert_weights_norm(cfg["norm_topk_prob"])
    writer.add_expert_group_count(cfg["n_group"])
    writer.add_expert_group_used_count(cfg["topk_group"])
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_rope_dimension_count(rope)
    add_tiny_tokenizer(writer)
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, w in load_file(os.path.join(folder, "model.safetensors")).items():
        w = w.astype(np.float32)
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            out[{"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}[name]] = w
            continue
        _, _, index, rest = name.split(".", 3)
        m = re.fullmatch(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight", rest)
        if m:
            experts.setdefault((index, m.group(2)), {})[int(m.group(1))] = w
        elif rest == "self_attn.kv_b_proj.weight" and split_kv_b:
            per_head = w.reshape(heads, nope + v_dim, rank)
            out[f"blk.{index}.attn_k_b.weight"] = per_head[:, :nope].transpose(0, 2, 1)
            out[f"blk.{index}.attn_v_b.weight"] = per_head[:, nope:]
        elif rest == "self_attn.kv_b_proj.weight":
            out[f"blk.{index}.attn_kv_b.weight"] = w
        else:
            out[f"blk.{index}.{_GGUF_NAMES[rest]}"] = w
    for (index, part), by_expert in experts.items():
        out[f"blk.{index}.ffn_{part}_exps.weight"] = np.stack([by_expert[e] for e in sorted(by_expert)])
    for key, w in out.items():
        w = np.ascontiguousarray(w)
        if quantize and w.ndim >= 2 and w.shape[-1] % 32 == 0:
            q = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(key, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(key, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)
