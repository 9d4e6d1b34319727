"""Tiny random-weight hybrid models (HF folders written by transformers' save_pretrained) for tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.hybrid_mtp_fixtures import add_mtp, mtp_as_converted
from tests.model_fixtures import tiny_vocab_size, write_tokenizer_files

HYBRID_ARCHS = ("lfm2", "qwen3_5", "granitemoehybrid", "granitemoehybrid_moe", "nemotron_h", "nemotron_h_moe",
                "falcon_h1")
HYBRID_ARCHS += ("qwen3_next", "qwen3_5_moe")  # gated DeltaNet with experts
HYBRID_ARCHS += ("lfm2_moe",)  # short convolutions with sigmoid-routed experts
# families whose RMSNorm weights (outside the DeltaNet) are stored as w - 1
_CENTRED_NORMS = ("qwen3_5", "qwen3_next", "qwen3_5_moe")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models: one thread is an order of magnitude faster than two contended ones on a busy machine (a
    module that imports this fixture runs with it)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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
    if arch == "lfm2_moe":  # a dense MLP on layer 0, then 6 experts (2 per token) routed by sigmoid + bias
        return transformers.Lfm2MoeConfig(
            **common, intermediate_size=96, moe_intermediate_size=32, num_experts=6, num_experts_per_tok=2,
            num_dense_layers=1, routed_scaling_factor=1.5, conv_L_cache=3, norm_eps=1e-5,
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
    if arch in ("qwen3_next", "qwen3_5_moe"):
        return _qwen_moe_config(arch, common)
    if arch == "granitemoehybrid":  # dense (Granite-4.0-H-Micro-like), NoPE attention, non-trivial multipliers
        return transformers.GraniteMoeHybridConfig(
            **common, intermediate_size=128, shared_intermediate_size=128, num_local_experts=0,
            num_experts_per_tok=0, rms_norm_eps=1e-6, tie_word_embeddings=False, position_embedding_type="nope",
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
            mamba_chunk_size=32, mamba_conv_bias=True, embedding_multiplier=2.0, residual_multiplier=0.5,
            attention_multiplier=0.2, logits_scaling=1.5,
        )
    if arch == "granitemoehybrid_moe":  # Granite-4.0-H-Tiny-like: routed experts beside the shared MLP
        return transformers.GraniteMoeHybridConfig(
            **common, intermediate_size=48, shared_intermediate_size=64, num_local_experts=6,
            num_experts_per_tok=2, rms_norm_eps=1e-6, tie_word_embeddings=False, position_embedding_type="nope",
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
            mamba_chunk_size=32, mamba_conv_bias=True, embedding_multiplier=2.0, residual_multiplier=0.5,
            attention_multiplier=0.2, logits_scaling=1.5,
        )
    if arch == "nemotron_h":  # one block per layer: Mamba-2, attention, relu2 MLP, attention
        common.pop("num_hidden_layers")
        return transformers.NemotronHConfig(
            **common, head_dim=16, intermediate_size=96, layers_block_type=["linear_attention", "full_attention",
                                                                           "mlp", "full_attention"],
            ssm_state_size=16, mamba_num_heads=8, mamba_head_dim=16, n_groups=2, conv_kernel=4, chunk_size=32,
            use_conv_bias=True, layer_norm_epsilon=1e-5, tie_word_embeddings=False,
        )
    if arch == "nemotron_h_moe":  # Nemotron-3-like: a MoE block (grouped sigmoid routing, latent projection)
        common.pop("num_hidden_layers")
        return transformers.NemotronHConfig(
            **common, head_dim=16, layers_block_type=["linear_attention", "full_attention", "moe", "full_attention"],
            ssm_state_size=16, mamba_num_heads=8, mamba_head_dim=16, n_groups=2, conv_kernel=4, chunk_size=32,
            layer_norm_epsilon=1e-5, tie_word_embeddings=False, n_routed_experts=8, num_experts_per_tok=3,
            moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, moe_latent_size=24, n_group=2,
            topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
        )
    if arch == "falcon_h1":  # attention and Mamba-2 in every layer, every muP multiplier away from 1
        return transformers.FalconH1Config(
            **common, intermediate_size=96, head_dim=16, rms_norm_eps=1e-5, tie_word_embeddings=False,
            mamba_d_ssm=128, mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
            mamba_chunk_size=32, mamba_conv_bias=True, mamba_rms_norm=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, embedding_multiplier=1.5,
            lm_head_multiplier=0.7, attention_in_multiplier=0.8, attention_out_multiplier=0.6, key_multiplier=1.3,
            ssm_in_multiplier=0.9, ssm_out_multiplier=1.2, ssm_multipliers=[0.5, 1.1, 0.9, 1.2, 0.8],
            mlp_multipliers=[0.75, 1.25],
        )
    raise ValueError(f"arch: expected one of {', '.join(HYBRID_ARCHS)}, got {arch!r}")


def _qwen_moe_config(arch: str, common: dict):
    """Qwen3-Next (a dense MLP on layer 2 through mlp_only_layers, experts elsewhere) or Qwen3.5-MoE (experts on
    every layer): 4 experts, 2 per token, a gated shared expert, the DeltaNet and attention shapes of tiny Qwen3.5."""
    import transformers

    shape = dict(
        **{**common, "initializer_range": 0.08}, head_dim=16, rms_norm_eps=1e-6, tie_word_embeddings=False,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    )
    if arch == "qwen3_next":
        return transformers.Qwen3NextConfig(**shape, intermediate_size=128, decoder_sparse_step=1,
                                            mlp_only_layers=[2], norm_topk_prob=True)
    return transformers.Qwen3_5MoeTextConfig(**shape)


def write_tiny_hybrid(tmp_path: str | os.PathLike, arch: str, *, seed: int = 0, overrides: dict | None = None,
                      mtp: bool = False) -> str:
    """Write a random-weight `arch` hybrid under tmp_path (safetensors + tokenizer); returns the folder.
    `overrides`: config attributes set on top of `tiny_hybrid_config(arch)`. `mtp` (Qwen3-Next, Qwen3.5): the file
    also holds a next-token layer under `mtp.*`, as the released checkpoints do (`hybrid_mtp_fixtures.add_mtp`)."""
    import torch
    import transformers

    config = tiny_hybrid_config(arch)
    for name, value in (overrides or {}).items():
        setattr(config, name, value)
    folder = Path(tmp_path) / f"tiny-{arch}"
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # Non-trivial norm weights and biases, so a missing or misplaced one shows in parity tests.
        for name, param in model.named_parameters():
            if "norm" in name:
                # Qwen3.5 stores its RMSNorm weights (outside the DeltaNet) as w - 1.
                centred = arch in _CENTRED_NORMS and "linear_attn.norm" not in name
                param.uniform_(-0.5, 0.5) if centred else param.uniform_(0.5, 1.5)
            elif name.endswith((".bias", "e_score_correction_bias")):
                param.normal_(0.0, 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("expert_bias"):  # LFM2-MoE's: a buffer, zero unless set
                buffer.normal_(0.0, 0.5)
    transformers.utils.logging.disable_progress_bar()
    model.save_pretrained(folder)
    if mtp:
        if arch not in _CENTRED_NORMS:
            raise ValueError(f"mtp: the fixture writes next-token layers for {', '.join(_CENTRED_NORMS)}, not {arch!r}")
        add_mtp(folder / "model.safetensors", seed)
    write_tokenizer_files(folder)
    return str(folder)


def write_tiny_hybrid_gguf(tmp_path: str | os.PathLike, arch: str = "lfm2", *, quantize: bool = False,
                           mtp: bool = False) -> str:
    """Convert the tiny `arch` HF model (lfm2, granitemoehybrid or qwen3_5) to GGUF as llama.cpp's converter
    does: tensor names from gguf's own name map, the depthwise conv squeezed to 2-D, per-layer K/V head counts
    with 0 for recurrent layers; for Granite also A = -exp(A_log), [heads, 1] A and D, the grouped norm as
    [groups, inner / groups], the shared MLP split into gate and up, q/k rows permuted as for llama; for
    Qwen3.5 and Qwen3.5-MoE A = -exp(A_log), 1 + w for the norms outside the DeltaNet and the value heads in tiled
    order (`_tile_v_heads`); for Qwen3-Next the same without the tiling, in_proj_qkvz regrouped into attn_qkv and
    attn_gate (`_qwen_moe_rewrite`, which also stacks the experts of both MoE families). 2-D weights but the routers
    in Q8_0 when `quantize`. Returns the .gguf path; the HF folder sits beside it (Qwen3-Next's without dense
    layers: llama.cpp's qwen3next has none). `mtp` (the Qwen families): the folder's next-token layer too, renamed
    as llama.cpp's converter does (`hybrid_mtp_fixtures.mtp_as_converted`: a layer after the model's, its own tensors as `nextn.*`, counted
    in `block_count` and `nextn_predict_layers`)."""
    import json

    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    from engine.model.hybrid.lfm2 import mlp_size
    from tests.model_fixtures import CHATML_TEMPLATE, SPECIAL_TOKENS, tiny_tokenizer_json

    family = {"granitemoehybrid_moe": "granitemoehybrid", "nemotron_h_moe": "nemotron_h"}.get(arch, arch)
    gguf_arch = {"lfm2": "lfm2", "lfm2_moe": "lfm2moe", "granitemoehybrid": "granitehybrid", "granitemoehybrid_moe": "granitehybrid",
                 "qwen3_5": "qwen35", "qwen3_next": "qwen3next", "qwen3_5_moe": "qwen35moe",
                 "nemotron_h": "nemotron_h", "nemotron_h_moe": "nemotron_h_moe", "falcon_h1": "falcon-h1"}.get(arch)
    if gguf_arch is None:
        raise ValueError(f"arch: only {', '.join(HYBRID_ARCHS)} have a GGUF writer here, got {arch!r}")
    # llama.cpp's qwen3next has no dense-MLP layers: its converter cannot name one
    folder = write_tiny_hybrid(tmp_path, arch, overrides={"mlp_only_layers": []} if arch == "qwen3_next" else None,
                               mtp=mtp)
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    types = cfg.get("layer_types") or cfg.get("layers_block_type") or ["parallel"] * cfg["num_hidden_layers"]
    n_layers, n_heads, n_kv = len(types), cfg["num_attention_heads"], cfg["num_key_value_heads"]
    experts = int(cfg.get("num_local_experts") or 0)
    path = Path(tmp_path) / f"tiny-{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), gguf_arch)
    writer.add_block_count(n_layers + mtp)
    if mtp:
        writer.add_nextn_predict_layers(1)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_head_count(n_heads)
    qwen = arch in _CENTRED_NORMS  # the gated-DeltaNet families
    if arch == "falcon_h1":  # every layer has attention
        writer.add_head_count_kv(n_kv)
    elif qwen:  # one K/V head count; the layer pattern as full_attention_interval (and for the MoE ones per layer)
        writer.add_head_count_kv(n_kv)
        first = cfg["layer_types"].index("full_attention") + 1
        assert all((t == "full_attention") == ((i + 1) % first == 0) for i, t in enumerate(cfg["layer_types"]))
        writer.add_full_attention_interval(first)
        if arch != "qwen3_5":
            writer.add_array(f"{gguf_arch}.attention.recurrent_layers",
                             [t == "linear_attention" for t in cfg["layer_types"]])
    else:
        writer.add_head_count_kv([n_kv if t == "full_attention" else 0 for t in types])
    if "rope_parameters" in cfg:
        writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    writer.add_vocab_size(cfg["vocab_size"])
    if arch == "lfm2":
        writer.add_feed_forward_length(mlp_size(cfg))
        writer.add_layer_norm_rms_eps(cfg["norm_eps"])
        writer.add_shortconv_l_cache(cfg["conv_L_cache"])
    elif arch == "lfm2_moe":  # as llama.cpp's LFM2MoeModel
        writer.add_feed_forward_length(cfg["intermediate_size"])
        writer.add_layer_norm_rms_eps(cfg["norm_eps"])
        writer.add_shortconv_l_cache(cfg["conv_L_cache"])
        writer.add_expert_count(cfg["num_experts"])
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        writer.add_leading_dense_block_count(cfg["num_dense_layers"])
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        if cfg["routed_scaling_factor"] != 1.0:  # the converter writes none (released models have 1.0)
            writer.add_expert_weights_scale(cfg["routed_scaling_factor"])
    elif qwen:
        if "intermediate_size" in cfg:  # Qwen3.5-MoE has none
            writer.add_feed_forward_length(cfg["intermediate_size"])
        if arch != "qwen3_5":  # Qwen2-MoE's keys (the converter writes no expert_weights_norm)
            writer.add_expert_count(cfg["num_experts"])
            writer.add_expert_used_count(cfg["num_experts_per_tok"])
            writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
            writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
        writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
        writer.add_key_length(cfg["head_dim"])
        writer.add_value_length(cfg["head_dim"])
        writer.add_rope_dimension_count(int(cfg["head_dim"] * cfg["rope_parameters"]["partial_rotary_factor"]))
        writer.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
        writer.add_ssm_state_size(cfg["linear_key_head_dim"])
        writer.add_ssm_group_count(cfg["linear_num_key_heads"])
        writer.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
        writer.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    elif arch == "falcon_h1":  # as llama.cpp's FalconH1Model (a Mamba2Model)
        writer.add_feed_forward_length(cfg["intermediate_size"])
        writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
        writer.add_key_length(cfg["head_dim"])
        writer.add_value_length(cfg["head_dim"])
        writer.add_ssm_conv_kernel(cfg["mamba_d_conv"])
        writer.add_ssm_state_size(cfg["mamba_d_state"])
        writer.add_ssm_group_count(cfg["mamba_n_groups"])
        writer.add_ssm_inner_size(cfg["mamba_d_ssm"])
        writer.add_ssm_time_step_rank(cfg["mamba_d_ssm"] // cfg["mamba_d_head"])
    elif family == "nemotron_h":  # as llama.cpp's NemotronHModel: per-layer feed-forward lengths, 0 off the MLP blocks
        sizes = {"mlp": cfg["intermediate_size"], "moe": cfg["moe_intermediate_size"]}
        writer.add_feed_forward_length([sizes.get(t, 0) for t in types])
        writer.add_layer_norm_eps(cfg["layer_norm_epsilon"])
        writer.add_key_length(cfg["head_dim"])
        writer.add_value_length(cfg["head_dim"])
        writer.add_ssm_conv_kernel(cfg["conv_kernel"])
        writer.add_ssm_state_size(cfg["ssm_state_size"])
        writer.add_ssm_group_count(cfg["n_groups"])
        writer.add_ssm_inner_size(cfg["mamba_num_heads"] * cfg["mamba_head_dim"])
        writer.add_ssm_time_step_rank(cfg["mamba_num_heads"])
        writer.add_rope_scaling_finetuned(False)
        if "moe" in types:
            writer.add_expert_count(cfg["n_routed_experts"])
            writer.add_expert_shared_count(cfg["n_shared_experts"])
            writer.add_expert_weights_norm(cfg["norm_topk_prob"])
            writer.add_expert_weights_scale(cfg["routed_scaling_factor"])
            writer.add_expert_group_count(cfg["n_group"])
            # not written by llama.cpp's converter (it has no topk_group); the loader refuses groups without it
            writer.add_expert_group_used_count(cfg["topk_group"])
            writer.add_expert_used_count(cfg["num_experts_per_tok"])
            writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
            writer.add_expert_shared_feed_forward_length(cfg["moe_shared_expert_intermediate_size"])
            if cfg.get("moe_latent_size"):
                writer.add_moe_latent_size(cfg["moe_latent_size"])
    else:
        inner = cfg["mamba_expand"] * cfg["hidden_size"]
        writer.add_feed_forward_length(cfg["intermediate_size"])
        writer.add_expert_shared_feed_forward_length(cfg["shared_intermediate_size"])
        writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
        writer.add_ssm_conv_kernel(cfg["mamba_d_conv"])
        writer.add_ssm_state_size(cfg["mamba_d_state"])
        writer.add_ssm_group_count(cfg["mamba_n_groups"])
        writer.add_ssm_inner_size(inner)
        writer.add_ssm_time_step_rank(cfg["mamba_n_heads"])
        writer.add_embedding_scale(cfg["embedding_multiplier"])
        writer.add_residual_scale(cfg["residual_multiplier"])
        writer.add_attention_scale(cfg["attention_multiplier"])
        writer.add_logit_scale(cfg["logits_scaling"])
        writer.add_rope_scaling_finetuned(False)  # Granite-4.0-H attention is NoPE
        writer.add_expert_count(experts)
        if experts:
            writer.add_expert_used_count(cfg["num_experts_per_tok"])

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

    def permute(w: np.ndarray, heads: int) -> np.ndarray:
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    model_arch = {"lfm2": gguf.MODEL_ARCH.LFM2, "lfm2_moe": gguf.MODEL_ARCH.LFM2MOE, "granitemoehybrid": gguf.MODEL_ARCH.GRANITE_HYBRID,
                  "qwen3_5": gguf.MODEL_ARCH.QWEN35, "qwen3_next": gguf.MODEL_ARCH.QWEN3NEXT,
                  "qwen3_5_moe": gguf.MODEL_ARCH.QWEN35MOE, "nemotron_h": gguf.MODEL_ARCH.NEMOTRON_H,
                  "nemotron_h_moe": gguf.MODEL_ARCH.NEMOTRON_H_MOE, "falcon_h1": gguf.MODEL_ARCH.FALCON_H1,
                  }[arch if family == "nemotron_h" else family]
    names = gguf.get_tensor_name_map(model_arch, n_layers + mtp)
    out_tensors: list[tuple[str, np.ndarray]] = []
    per_expert: dict[tuple[str, str], dict[int, np.ndarray]] = {}  # Nemotron-H: stacked as the converter does
    weights = load_file(os.path.join(folder, "model.safetensors"))
    nextn = mtp_as_converted(weights, n_layers)  # the layer's own tensors' names, which gguf's map lacks here
    if arch in ("qwen3_next", "qwen3_5_moe"):
        weights, out_tensors = _qwen_moe_rewrite(cfg, weights)
    for name, w in weights.items():
        w = w.astype(np.float32)
        if ".mixer.experts." in name or ".feed_forward.experts." in name:
            _, _, block, _, _, index, part, _ = name.split(".")
            per_expert.setdefault((block, part), {})[int(index)] = w
            continue
        if name.endswith(".feed_forward.expert_bias"):  # LFM2-MoE's converter names it as a bias
            name = name.removesuffix("expert_bias") + "expert_bias.bias"
        if name.endswith("e_score_correction_bias"):
            name = name.removesuffix("_bias") + ".bias"
        if arch == "qwen3_next" and name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            w = w + 1.0
        elif qwen and arch != "qwen3_next":
            w = _qwen35_rewrite(cfg, name, w)
        if arch == "falcon_h1":
            w = _falcon_fold(cfg, name, w)
        if name.endswith(".dt_bias"):
            name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
        block = name.split(".")[2] if ".layers." in name else ""
        if name.endswith("block_sparse_moe.input_linear.weight"):  # [experts, gate; up, hidden]
            gate, up = np.split(w, 2, axis=1)
            out_tensors += [(f"blk.{block}.ffn_gate_exps.weight", gate), (f"blk.{block}.ffn_up_exps.weight", up)]
            continue
        if experts and name.endswith("shared_mlp.input_linear.weight"):  # with experts: the shared expert's names
            gate, up = np.split(w, 2, axis=0)
            out_tensors += [(f"blk.{block}.ffn_gate_shexp.weight", gate), (f"blk.{block}.ffn_up_shexp.weight", up)]
            continue
        if experts and name.endswith("shared_mlp.output_linear.weight"):
            out_tensors.append((f"blk.{block}.ffn_down_shexp.weight", w))
            continue
        if name.endswith("shared_mlp.input_linear.weight"):
            gate, up = np.split(w, 2, axis=0)
            prefix = name.removesuffix("shared_mlp.input_linear.weight")
            out_tensors += [(names.get_name(prefix + "mlp.gate_proj.weight", try_suffixes=(".weight",)), gate),
                            (names.get_name(prefix + "mlp.up_proj.weight", try_suffixes=(".weight",)), up)]
            continue
        if name.endswith("shared_mlp.output_linear.weight"):
            name = name.replace("shared_mlp.output_linear", "mlp.down_proj")
        out = nextn.get(name) or names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert out is not None, f"no GGUF name for {name}"
        if ".conv.conv." in name or ".conv1d.weight" in name:
            w = w.squeeze(1)
        elif name.endswith(".A_log"):
            w = -np.exp(w) if qwen else -np.exp(w).reshape(-1, 1)
        elif name.endswith(".D"):
            w = w.reshape(-1, 1)
        elif name.endswith(("mamba.norm.weight", "mixer.norm.weight")) and arch != "falcon_h1":
            w = w.reshape(cfg.get("mamba_n_groups") or cfg["n_groups"], -1)
        elif family in ("granitemoehybrid", "nemotron_h") and name.endswith(("self_attn.q_proj.weight", "mixer.q_proj.weight")):
            w = permute(w, n_heads)  # Granite and Nemotron-H convert through llama's q/k permutation
        elif family in ("granitemoehybrid", "nemotron_h") and name.endswith(("self_attn.k_proj.weight", "mixer.k_proj.weight")):
            w = permute(w, n_kv)
        out_tensors.append((out, w))
    for (block, part), by_index in sorted(per_expert.items()):
        stacked = np.stack([by_index[j] for j in sorted(by_index)])
        # LFM2-MoE's converter names the stacked experts "layers.<i>.feed_forward.experts.w1.weight" (no "model.")
        stack = (f"layers.{block}.feed_forward.experts.{part}.weight" if arch == "lfm2_moe"
                 else f"model.layers.{block}.mlp.experts.{part}.weight")
        out_tensors.append((names.get_name(stack, try_suffixes=(".weight",)), stacked))
    for out, w in out_tensors:
        # norms and the routers stay float, as llama.cpp keeps them
        if quantize and w.ndim == 2 and w.shape[1] % 32 == 0 and "norm" not in out and "ffn_gate_inp" not in out:
            q = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(out, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(out, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def _qwen_moe_rewrite(cfg: dict, weights: dict) -> tuple[dict, list]:
    """What llama.cpp's Qwen2-MoE / Qwen3-Next converter does before naming: each layer's experts stacked into
    [experts, ...] tensors, and Qwen3-Next's fused per-key-head in_proj_qkvz regrouped into attn_qkv (q | k | v)
    and attn_gate (z). Returns (the tensors still to name, the (GGUF name, tensor) pairs already named)."""
    import re

    import numpy as np

    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    rest, named = {}, []
    nk, dk, dv = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    per_k = cfg["linear_num_value_heads"] // nk
    for name, w in weights.items():
        m = re.fullmatch(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)\.weight", name)
        if m:
            experts.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = w
        elif name.endswith("linear_attn.in_proj_qkvz.weight"):
            layer = name.split(".")[2]
            g = w.astype(np.float32).reshape(nk, 2 * dk + 2 * per_k * dv, -1)
            q, k, v, z = np.split(g, [dk, 2 * dk, 2 * dk + per_k * dv], axis=1)
            named.append((f"blk.{layer}.attn_qkv.weight",
                          np.concatenate([t.reshape(-1, g.shape[-1]) for t in (q, k, v)])))
            named.append((f"blk.{layer}.attn_gate.weight", np.ascontiguousarray(z.reshape(-1, g.shape[-1]))))
        else:
            rest[name] = w
    for (prefix, part), by_index in experts.items():
        rest[f"{prefix}.{part}.weight"] = np.stack([by_index[i] for i in sorted(by_index)])
    return rest, named


def _falcon_fold(cfg: dict, name: str, w):
    """What llama.cpp's converter does to a Falcon-H1 tensor: its muP multipliers folded in, the grouped norm as
    [groups, inner / groups]."""
    gate_mult, down_mult = cfg["mlp_multipliers"]
    attn_in = cfg["attention_in_multiplier"]
    for part, factor in (("down_proj", down_mult), ("gate_proj", gate_mult), ("k_proj", cfg["key_multiplier"] * attn_in),
                         ("q_proj", attn_in), ("v_proj", attn_in), ("o_proj", cfg["attention_out_multiplier"]),
                         ("out_proj", cfg["ssm_out_multiplier"]), ("lm_head", cfg["lm_head_multiplier"]),
                         ("embed_tokens", cfg["embedding_multiplier"])):
        if part in name:
            return w * factor
    if "in_proj" in name:
        inner, bc = cfg["mamba_d_ssm"], cfg["mamba_n_groups"] * cfg["mamba_d_state"]
        w = w * cfg["ssm_in_multiplier"]
        for (lo, hi), factor in zip(((0, inner), (inner, 2 * inner), (2 * inner, 2 * inner + bc),
                                     (2 * inner + bc, 2 * inner + 2 * bc), (2 * inner + 2 * bc, None)),
                                    cfg["ssm_multipliers"], strict=True):
            w[lo:hi] *= factor
        return w
    if "mamba.norm" in name:
        return w.reshape(cfg["mamba_n_groups"], -1)
    return w


def _tile_v_heads(w, axis: int, k_heads: int, per_k: int, head_dim: int):
    """Value heads along `axis` from grouped by key head to llama.cpp's tiled order (the converter's reorder)."""
    import numpy as np

    shape = list(w.shape)
    split = shape[:axis] + [k_heads, per_k, head_dim] + shape[axis + 1:]
    return np.ascontiguousarray(np.swapaxes(w.reshape(split), axis, axis + 1).reshape(shape))


def _qwen35_rewrite(cfg: dict, name: str, w):
    """What llama.cpp's converter does to a Qwen3.5 tensor before naming it: 1 + w for the norms outside the
    DeltaNet, and with fewer key than value heads the value heads tiled (A_log and the conv squeeze are done
    by the caller, as for Granite)."""
    import numpy as np

    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return w + 1.0
    k, v = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    per_k, vd, qk = v // k, cfg["linear_value_head_dim"], 2 * k * cfg["linear_key_head_dim"]
    if per_k == 1 or ".linear_attn." not in name:
        return w
    if name.endswith((".in_proj_qkv.weight", ".conv1d.weight")):
        return np.concatenate((w[:qk], _tile_v_heads(w[qk:], 0, k, per_k, vd)))
    if name.endswith(".in_proj_z.weight"):
        return _tile_v_heads(w, 0, k, per_k, vd)
    if name.endswith((".in_proj_a.weight", ".in_proj_b.weight", ".A_log", ".dt_bias")):
        return _tile_v_heads(w, 0, k, per_k, 1)
    if name.endswith(".out_proj.weight"):
        return _tile_v_heads(w, 1, k, per_k, vd)
    return w
