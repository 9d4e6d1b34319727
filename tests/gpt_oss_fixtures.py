"""A tiny random-weight gpt-oss model in an HF folder (transformers' GptOssConfig), and the same model as a GGUF
written the way llama.cpp's conversion/gpt_oss.py names and lays it out, its experts in MXFP4.

The tiny model exercises what sets gpt-oss apart: attention sinks (drawn large enough to matter), a sliding
layer then a full one (window 8), biases on q/k/v, the output projection, the router and every expert, top-k
then softmax routing, and the clamped SwiGLU with a limit low enough that the clamps bite. With `mxfp4_grid`
every expert matrix lies on the MXFP4 grid (per block of 32 along its input), so the GGUF's MXFP4 experts hold
the HF model's values exactly and both load to the same logits.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.model_fixtures import TINY_SIZES, add_tiny_tokenizer, tiny_vocab_size, write_tokenizer_files

N_EXPERTS, TOP_K, EXPERT_SIZE, WINDOW = 8, 2, 32, 8


def tiny_gpt_oss_config(**overrides):
    """transformers' GptOssConfig for the tiny model (its own YaRN RoPE defaults kept)."""
    import transformers

    kwargs = dict(TINY_SIZES)
    kwargs.update(
        num_hidden_layers=4, vocab_size=tiny_vocab_size(), head_dim=16, num_local_experts=N_EXPERTS,
        num_experts_per_tok=TOP_K, intermediate_size=EXPERT_SIZE, sliding_window=WINDOW, swiglu_limit=1.0,
        rms_norm_eps=1e-6, initializer_range=0.25, tie_word_embeddings=False, bos_token_id=None, eos_token_id=2,
        pad_token_id=0,
    )
    kwargs.update(overrides)
    return transformers.GptOssConfig(**kwargs)


def write_tiny_gpt_oss(root: str | os.PathLike, *, seed: int = 0, mxfp4_grid: bool = False, hf_mxfp4: bool = False,
                       **overrides) -> str:
    """Write the random-weight tiny gpt-oss under `root`; returns the folder. With `hf_mxfp4` (on the grid) its
    experts are stored as a released checkpoint stores them, MXFP4 `*_blocks` / `*_scales`."""
    mxfp4_grid = mxfp4_grid or hf_mxfp4
    import torch
    import transformers

    config = tiny_gpt_oss_config(**overrides)
    folder = Path(root) / ("tiny-gpt-oss-hf-mxfp4" if hf_mxfp4 else "tiny-gpt-oss-mxfp4" if mxfp4_grid else "tiny-gpt-oss")
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # non-trivial norm weights, so a missing or misplaced norm shows
                param.uniform_(0.5, 1.5)
            elif name.endswith(("bias", "sinks")):
                if name.endswith("sinks"):  # large enough to take a good part of each softmax
                    param.normal_(2.0, 1.0)
                else:
                    param.normal_(0.0, 0.5)
            elif mxfp4_grid and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                # [experts, in, out]: MXFP4 blocks run along the input (the GGUF's last dimension)
                param.copy_(on_mxfp4_grid(param.transpose(1, 2)).transpose(1, 2))
    transformers.utils.logging.disable_progress_bar()
    model.save_pretrained(folder)
    if hf_mxfp4:
        _store_experts_as_mxfp4(folder / "model.safetensors")
    write_tokenizer_files(folder)
    return str(folder)


def _store_experts_as_mxfp4(path: Path) -> None:
    """Replace the float expert stacks by MXFP4 blocks as gpt-oss's releases hold them: `*_blocks` [experts,
    out rows, blocks, 16] (byte j: value 2j low nibble, 2j + 1 high) and `*_scales` [experts, out rows, blocks]
    (e8m0, bias 127); gate_up's rows interleaved as in its float layout. Made from gguf-py's MXFP4 blocks, whose
    codes are the same indices (its table is e2m1 doubled, its exponent byte the same)."""
    import gguf
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = tensors.pop(name).transpose(1, 2).contiguous()  # [experts, out, in]
        q = torch.from_numpy(gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.MXFP4))
        q = q.view(*w.shape[:2], -1, 17)
        codes = torch.stack((q[..., 1:] & 0x0F, q[..., 1:] >> 4), dim=-2).flatten(-2)  # value order
        tensors[name + "_blocks"] = (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()
        tensors[name + "_scales"] = q[..., 0].contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})


def on_mxfp4_grid(w):
    """`w` rounded to MXFP4 per block of 32 along its last dimension, as gguf-py's quantiser rounds it (whose
    output it is, decoded): quantising the result again gives the same blocks, so the round trip is exact."""
    import gguf
    import numpy as np
    import torch

    blocks = gguf.quants.quantize(w.detach().float().numpy(), gguf.GGMLQuantizationType.MXFP4)
    values = gguf.quants.dequantize(np.ascontiguousarray(blocks), gguf.GGMLQuantizationType.MXFP4)
    return torch.from_numpy(np.ascontiguousarray(values)).reshape(w.shape)


# HF tensor name (after model.layers.N.) -> llama.cpp's, for what is not an expert stack.
_GGUF_NAMES = {
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.sinks": "attn_sinks.weight", "input_layernorm.weight": "attn_norm.weight",
    # GPT_OSS's tensor list has ATTN_POST_NORM, not FFN_NORM: its post_attention_layernorm is named so.
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "mlp.router.weight": "ffn_gate_inp.weight", "mlp.router.bias": "ffn_gate_inp.bias",
    "mlp.experts.down_proj_bias": "ffn_down_exps.bias",
}


def write_tiny_gpt_oss_gguf(root: str | os.PathLike, *, seed: int = 0, **overrides) -> str:
    """The tiny model (on the MXFP4 grid) as llama.cpp's converter writes a float gpt-oss checkpoint, with the
    expert stacks in MXFP4 as a released checkpoint's are: gate_up split into ffn_gate_exps / ffn_up_exps
    (even / odd columns) and transposed to [experts, out, in], down_proj transposed, their biases split the same
    way; q/k rows not permuted; the sliding window's size as the only window key (the period of 2 is
    llama.cpp's own); the clamp's limit llama.cpp's 7. Returns the .gguf path; the HF folder sits beside it."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    # llama.cpp builds in the clamp's limit of 7 (a GGUF has no key for it): the HF twin must use it too.
    folder = write_tiny_gpt_oss(root, seed=seed, mxfp4_grid=True, **{"swiglu_limit": 7.0, **overrides})
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    path = Path(root) / "tiny-gpt-oss.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    rope = cfg["rope_parameters"]
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_expert_count(cfg["num_local_experts"])
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    writer.add_sliding_window(cfg["sliding_window"])
    writer.add_expert_feed_forward_length(cfg["intermediate_size"])
    add_tiny_tokenizer(writer)
    mxfp4 = gguf.GGMLQuantizationType.MXFP4
    for name, w in load_file(os.path.join(folder, "model.safetensors")).items():
        w = np.ascontiguousarray(w.astype(np.float32))
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            writer.add_tensor({"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                               "lm_head.weight": "output.weight"}[name], w)
            continue
        _, _, index, rest = name.split(".", 3)
        p = f"blk.{index}."
        if rest == "mlp.experts.gate_up_proj":  # [experts, hidden, 2 * size], gate and up interleaved
            t = w.transpose(0, 2, 1)
            for part, rows in (("gate", t[:, 0::2]), ("up", t[:, 1::2])):
                q = gguf.quants.quantize(np.ascontiguousarray(rows), mxfp4)
                writer.add_tensor(f"{p}ffn_{part}_exps.weight", q, raw_shape=q.shape, raw_dtype=mxfp4)
        elif rest == "mlp.experts.down_proj":  # [experts, size, hidden]
            q = gguf.quants.quantize(np.ascontiguousarray(w.transpose(0, 2, 1)), mxfp4)
            writer.add_tensor(f"{p}ffn_down_exps.weight", q, raw_shape=q.shape, raw_dtype=mxfp4)
        elif rest == "mlp.experts.gate_up_proj_bias":
            writer.add_tensor(f"{p}ffn_gate_exps.bias", np.ascontiguousarray(w[:, 0::2]))
            writer.add_tensor(f"{p}ffn_up_exps.bias", np.ascontiguousarray(w[:, 1::2]))
        else:
            writer.add_tensor(p + _GGUF_NAMES[rest], w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)
