"""Tiny random-weight mixture-of-experts models in HF folders, from transformers' own config classes.

`write_tiny_moe_model(root, "qwen3_moe")` writes a folder both transformers and the engine load, with the same
tokenizer files as tests/model_fixtures.py. Each family's tiny config exercises what sets it apart: Qwen3-MoE
a dense layer among expert layers and renormalised top-k, Qwen2-MoE the gated shared expert and q/k/v bias,
OLMoE full-width q/k norms, GraniteMoE its four multipliers with tied embeddings.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from pathlib import Path

from tests.model_fixtures import (
    TINY_SIZES,
    add_tiny_tokenizer,
    on_int4_grid,
    tiny_vocab_size,
    write_tokenizer_files,
)

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
    # GLM-4.x MoE (tests/test_glm4_moe.py, not in MOE_ARCHS): one dense layer then three expert layers, two
    # expert groups of which one is kept, an ungated shared expert, half the head rotated, q/k/v biases, q/k
    # norms, and one next-token (MTP) layer after the last.
    "glm4_moe": dict(n_routed_experts=N_EXPERTS, moe_intermediate_size=EXPERT_SIZE, n_group=2, topk_group=1,
                     n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                     partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True, num_nextn_predict_layers=1,
                     num_hidden_layers=4, tie_word_embeddings=False),
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
        "glm4_moe": transformers.Glm4MoeConfig,
    }
    if arch not in classes:
        raise ValueError(f"arch: expected one of {', '.join(classes)}, got {arch!r}")
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
                param.copy_(on_int4_grid(param))
        for bname, buf in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):  # GLM: a bias that changes which experts are chosen
                buf.normal_(0.0, 0.3)
    transformers.utils.logging.disable_progress_bar()
    model.save_pretrained(folder)
    if arch == "glm4_moe":
        add_mtp_layers(folder, config)
    write_tokenizer_files(folder)
    return str(folder)


def add_mtp_layers(folder: Path, config) -> None:
    """Append next-token (MTP) layers to the checkpoint as GLM's and DeepSeek's releases hold them (transformers
    neither builds nor saves them): `model.layers.<n_layers + j>.` with a MoE decoder layer's tensors (those of the last
    layer, perturbed) and eh_proj, enorm, hnorm and shared_head.norm."""
    import torch
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    n, hidden = config.num_hidden_layers, config.hidden_size
    last = f"model.layers.{n - 1}."
    for j in range(config.num_nextn_predict_layers):
        p = f"model.layers.{n + j}."
        for name, t in list(tensors.items()):
            if name.startswith(last):
                tensors[p + name[len(last):]] = t + 0.01 * torch.randn_like(t)
        tensors[p + "eh_proj.weight"] = 0.1 * torch.randn(hidden, 2 * hidden)
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            tensors[p + norm + ".weight"] = 1.0 + 0.1 * torch.randn(hidden)
    save_file(tensors, str(path), metadata={"format": "pt"})


_GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "olmoe": "olmoe", "mixtral": "llama",
              "granitemoe": "granitemoe", "glm4_moe": "glm4moe"}
_GGUF_NAMES = {
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight", "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.router.layer.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.output_linear.weight": "ffn_down_exps.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",  # GLM-4.x MoE
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "eh_proj.weight": "nextn.eh_proj.weight", "enorm.weight": "nextn.enorm.weight",
    "hnorm.weight": "nextn.hnorm.weight", "shared_head.norm.weight": "nextn.shared_head_norm.weight",
}
# llama.cpp's GLM4_MOE tensor list has ATTN_POST_NORM, not FFN_NORM: its post_attention_layernorm is named so.
_GLM4_MOE_GGUF_NAMES = {**_GGUF_NAMES, "post_attention_layernorm.weight": "post_attention_norm.weight"}
_EXPERT = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight")
_EXPERT_GGUF = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def write_tiny_moe_gguf(root: str | os.PathLike, arch: str, *, seed: int = 0, quantize: bool = False,
                        expert_types: dict[str, str] | None = None, **overrides) -> str:
    """Convert a tiny MoE HF model to a GGUF the way llama.cpp's converter does: experts stacked into
    ffn_{gate,up,down}_exps, the router as ffn_gate_inp, the shared expert as ffn_*_shexp with its gate 1-D,
    q/k rows interleaved for the Llama-derived files (Mixtral, GraniteMoE); matrices and expert stacks in Q8_0
    when `quantize`. `expert_types` ("gate", "up", "down" -> a type name such as "Q4_K") sets the expert
    stacks' types; types gguf cannot quantise to (the K-quants) get random blocks, those experts then no longer
    the HF model's. `overrides` change the HF config (sizes). Returns the .gguf path; the HF folder sits
    beside it."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    from tests.model_fixtures import random_blocks

    folder = write_tiny_moe_model(root, arch, seed=seed, **overrides)
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    gguf_arch = _GGUF_ARCH[arch]
    n_heads, n_kv, hidden = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]
    path = Path(root) / f"tiny-{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), gguf_arch)
    glm = arch == "glm4_moe"
    # GLM's block_count includes its next-token (MTP) layers (Glm4MoeModel in llama.cpp's conversion/glm.py).
    writer.add_block_count(cfg["num_hidden_layers"] + (cfg["num_nextn_predict_layers"] if glm else 0))
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(n_kv)
    head_dim = cfg.get("head_dim") or hidden // n_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_expert_count(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg["n_routed_experts"])
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    if "moe_intermediate_size" in cfg:
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if arch == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if glm:
        writer.add_rope_dimension_count(int(head_dim * cfg["rope_parameters"]["partial_rotary_factor"]))
        writer.add_expert_shared_count(cfg["n_shared_experts"])
        writer.add_leading_dense_block_count(cfg["first_k_dense_replace"])
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        writer.add_expert_weights_scale(cfg["routed_scaling_factor"])
        writer.add_expert_weights_norm(cfg["norm_topk_prob"])
        writer.add_expert_group_count(cfg["n_group"])
        writer.add_expert_group_used_count(cfg["topk_group"])
        writer.add_nextn_predict_layers(cfg["num_nextn_predict_layers"])
    if arch == "granitemoe":
        writer.add_embedding_scale(cfg["embedding_multiplier"])
        writer.add_residual_scale(cfg["residual_multiplier"])
        writer.add_logit_scale(cfg["logits_scaling"])
        writer.add_attention_scale(cfg["attention_multiplier"])
    add_tiny_tokenizer(writer)

    def permute(w: np.ndarray, heads: int) -> np.ndarray:
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    permuted = gguf_arch in ("llama", "granitemoe")
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, w in load_file(os.path.join(folder, "model.safetensors")).items():
        w = w.astype(np.float32)
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = w
            continue
        if name == "model.norm.weight":
            out["output_norm.weight"] = w
            continue
        if name == "lm_head.weight":
            out["output.weight"] = w
            continue
        _, _, index, rest = name.split(".", 3)
        m = _EXPERT.fullmatch(rest)
        if m:
            experts.setdefault((index, _EXPERT_GGUF[m.group(2)]), {})[int(m.group(1))] = w
            continue
        if rest == "block_sparse_moe.input_linear.weight":  # GraniteMoE: [gate; up] per expert
            gate, up = np.split(w, 2, axis=1)
            out[f"blk.{index}.ffn_gate_exps.weight"], out[f"blk.{index}.ffn_up_exps.weight"] = gate, up
            continue
        key = f"blk.{index}.{(_GLM4_MOE_GGUF_NAMES if glm else _GGUF_NAMES)[rest]}"
        if permuted and key.endswith(("attn_q.weight", "attn_q.bias")):
            w = permute(w, n_heads)
        elif permuted and key.endswith(("attn_k.weight", "attn_k.bias")):
            w = permute(w, n_kv)
        out[key] = w.reshape(-1) if key.endswith("ffn_gate_inp_shexp.weight") else w
    for (index, part), by_expert in experts.items():
        out[f"blk.{index}.ffn_{part}_exps.weight"] = np.stack([by_expert[e] for e in sorted(by_expert)])
    for key, w in out.items():
        w = np.ascontiguousarray(w)
        part = re.fullmatch(r"blk\.\d+\.ffn_(gate|up|down)_exps\.weight", key)
        kind = (expert_types or {}).get(part.group(1)) if part else None
        if kind is None and quantize and w.ndim >= 2 and w.shape[-1] % 32 == 0:
            kind = "Q8_0"
        if kind is not None:
            qtype = gguf.GGMLQuantizationType[kind]
            try:
                q = gguf.quants.quantize(w, qtype)
            except NotImplementedError:
                flat = random_blocks(qtype, w.size // w.shape[-1], w.shape[-1], seed=zlib.crc32(key.encode()),
                                     scale=float(np.abs(w).mean()) / 200)
                q = flat.reshape(*w.shape[:-1], -1)
            writer.add_tensor(key, q, raw_shape=q.shape, raw_dtype=qtype)
        else:
            writer.add_tensor(key, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)
