"""Hybrid models from GGUF files, with llama.cpp's tensor names and metadata keys.

Supported:
- `lfm2` (llama.cpp's LFM2: `shortconv.*` tensors, the final norm stored as `token_embd_norm`,
  `attention.head_count_kv` per layer with 0 for the convolution layers, `shortconv.l_cache`);
- `lfm2moe` (LFM2-MoE): LFM2's, with `ffn_gate_inp`, `ffn_{gate,up,down}_exps` and `exp_probs_b.bias` on the
  expert layers (those from `leading_dense_block_count` on), `expert_count`, `expert_used_count`,
  `expert_feed_forward_length`, `expert_gating_func` 2 (sigmoid);
- `granitehybrid` with a dense MLP (Granite-4.0-H): `ssm_*` tensors as llama.cpp's Mamba-2 converter writes
  them (ssm_a = -exp(A_log) and ssm_d as [heads, 1], ssm_norm as [groups, inner / groups], the conv squeezed
  to 2-D, dt_bias as `ssm_dt.bias`), the shared MLP split into ffn_gate / ffn_up, q/k rows permuted as for
  llama, the embeddings padded to a multiple of 8 rows, Granite's scales as `embedding_scale`,
  `residual_scale`, `attention.scale`, `logit_scale`, RoPE only when `rope.scaling.finetuned` is set.
- `granitehybrid` with experts (Granite-4.0-H-Tiny, -Small): the routed experts as `ffn_gate_inp`,
  `ffn_{gate,up,down}_exps` and `expert_count`, `expert_used_count`, `feed_forward_length` (one expert's size),
  the shared MLP as `ffn_{gate,up,down}_shexp` and `expert_shared_feed_forward_length`;
- `falcon-h1` (Falcon-H1): `engine.model.hybrid.gguf_falcon` (its multipliers are folded into the weights);
- `nemotron_h`, `nemotron_h_moe` (Nemotron-H): `engine.model.hybrid.gguf_nemotron` reads its block pattern and experts;
- `qwen35` (Qwen3.5), `qwen35moe` (Qwen3.5-MoE) and `qwen3next` (Qwen3-Next): `engine.model.hybrid.gguf_qwen35`
  undoes what llama.cpp's converter rewrites (the value-head order, the +1 folded into the norms, -exp(A_log),
  Qwen3-Next's regrouped qkvz); their experts have Qwen2-MoE's tensor names and keys; their next-token layer
  (`blk.<n_layers>.*` with `nextn.*`, counted in `block_count`) is kept for `--spec mtp` (engine/model/mtp.py).
"""

from __future__ import annotations

import os
import struct
from typing import Any

import torch
import xxhash

from engine.errors import ModelLoadError
from engine.model import families, gguf_dequant, moe_loading, mtp
from engine.model.build import LoadedModel
from engine.model.gguf_header import GGUFTensor, forget_headers, read_gguf_header
from engine.model.gguf_tensors import check_gguf_tensors, unpermute
from engine.model.hybrid import gguf_falcon, gguf_mamba, gguf_nemotron, gguf_qwen35, lfm2_moe
from engine.model.hybrid.config import ATTENTION, MAMBA, SHORT_CONV, HybridConfig
from engine.model.hybrid.loader import build_hybrid
from engine.model.moe_config import MoeConfig
from engine.model.quant_embedding import QuantEmbedding
from engine.model.tokenizer import Tokenizer, TokenizerError

GGUF_ARCHITECTURES = tuple(families.gguf_architectures("hybrid"))  # the registry's, engine/model/families.py
NOT_YET = ("mamba2",)

_LFM2_LAYER_NAMES = {
    "attn_norm.weight": "mixer_norm", "ffn_norm.weight": "mlp_norm",
    "attn_q.weight": "q", "attn_k.weight": "k", "attn_v.weight": "v", "attn_output.weight": "o",
    "attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm",
    "shortconv.in_proj.weight": "conv_in", "shortconv.in_proj.bias": "conv_in_bias",
    "shortconv.conv.weight": "conv", "shortconv.conv.bias": "conv_bias",
    "shortconv.out_proj.weight": "conv_out", "shortconv.out_proj.bias": "conv_out_bias",
    "ffn_gate.weight": "gate", "ffn_up.weight": "up", "ffn_down.weight": "down",
}
_LFM2_GLOBAL_NAMES = {"token_embd.weight": "embed", "token_embd_norm.weight": "norm", "output.weight": "lm_head"}
# LFM2-MoE: LFM2's names, and on its expert layers the router, the stacked experts and the bias that chooses them
_LFM2_MOE_LAYER_NAMES = {
    **_LFM2_LAYER_NAMES, "ffn_gate_inp.weight": "router", "ffn_gate_exps.weight": "experts.gate",
    "ffn_up_exps.weight": "experts.up", "ffn_down_exps.weight": "experts.down", "exp_probs_b.bias": "expert_bias",
}
_GRANITE_LAYER_NAMES = {
    "attn_norm.weight": "mixer_norm", "ffn_norm.weight": "mlp_norm",
    "attn_q.weight": "q", "attn_k.weight": "k", "attn_v.weight": "v", "attn_output.weight": "o",
    "ssm_in.weight": "ssm_in", "ssm_conv1d.weight": "conv", "ssm_conv1d.bias": "conv_bias", "ssm_dt.bias": "dt_bias",
    "ssm_a": "neg_a", "ssm_d": "d_skip", "ssm_norm.weight": "ssm_norm", "ssm_out.weight": "ssm_out",
    "ffn_gate.weight": "gate", "ffn_up.weight": "up", "ffn_down.weight": "down",
    # with experts: the router and the stacked experts; the shared MLP under the dense MLP's keys
    "ffn_gate_inp.weight": "router", "ffn_gate_exps.weight": "experts.gate", "ffn_up_exps.weight": "experts.up",
    "ffn_down_exps.weight": "experts.down",
    "ffn_gate_shexp.weight": "gate", "ffn_up_shexp.weight": "up", "ffn_down_shexp.weight": "down",
}
_GRANITE_GLOBAL_NAMES = {"token_embd.weight": "embed", "output_norm.weight": "norm", "output.weight": "lm_head"}
_NAMES = {"lfm2": (_LFM2_GLOBAL_NAMES, _LFM2_LAYER_NAMES), "lfm2moe": (_LFM2_GLOBAL_NAMES, _LFM2_MOE_LAYER_NAMES),
          "granitehybrid": (_GRANITE_GLOBAL_NAMES, _GRANITE_LAYER_NAMES),
          "qwen35": (gguf_qwen35.GLOBAL_NAMES, gguf_qwen35.LAYER_NAMES)}
_NAMES |= {arch: _NAMES["qwen35"] for arch in gguf_qwen35.GGUF_ARCHITECTURES}
_NAMES |= {arch: (gguf_nemotron.GLOBAL_NAMES, gguf_nemotron.LAYER_NAMES) for arch in gguf_nemotron.ARCHITECTURES}
_NAMES[gguf_falcon.ARCHITECTURE] = (gguf_falcon.GLOBAL_NAMES, gguf_falcon.LAYER_NAMES)
assert set(_NAMES) == set(GGUF_ARCHITECTURES), "a tensor-name table for each registered GGUF hybrid architecture"


def is_hybrid_gguf(meta: dict) -> bool:
    """The file's architecture is a hybrid one (supported, or refused with a reason by `hybrid_gguf_config`)."""
    arch = meta.get("general.architecture")
    return arch in GGUF_ARCHITECTURES or arch in NOT_YET


def hybrid_gguf_config(meta: dict, tensor_names: set[str], path: str, embed_rows: int) -> HybridConfig:
    """The model's shape from GGUF metadata; `embed_rows` is the token embedding's row count (llama.cpp's
    Mamba-2 converter pads the vocabulary, so the metadata's token count can be smaller)."""
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: GGUF architecture {arch!r} (a hybrid model) is not supported from GGUF yet; "
            f"load its Hugging Face folder instead (GGUF hybrids supported: {', '.join(GGUF_ARCHITECTURES)})"
        )

    if arch in gguf_qwen35.GGUF_ARCHITECTURES:
        return gguf_qwen35.config(meta, tensor_names, path, embed_rows)
    if arch in gguf_nemotron.ARCHITECTURES:
        return gguf_nemotron.config(meta, tensor_names, path, embed_rows)
    if arch == gguf_falcon.ARCHITECTURE:
        return gguf_falcon.config(meta, tensor_names, path, embed_rows)

    def key(name: str, default=None):
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"{path}: metadata {arch}.{name} is missing")
        return value

    n_layers = int(key("block_count"))
    kv = key("attention.head_count_kv")
    kv_per_layer = [int(v) for v in kv] if isinstance(kv, list) else [int(kv)] * n_layers
    if len(kv_per_layer) != n_layers:
        raise ModelLoadError(f"{path}: {arch}.attention.head_count_kv has {len(kv_per_layer)} entries for {n_layers} layers")
    recurrent = SHORT_CONV if arch in ("lfm2", "lfm2moe") else MAMBA
    kinds = tuple(ATTENTION if n else recurrent for n in kv_per_layer)
    attention_kv = sorted({n for n in kv_per_layer if n})
    if len(attention_kv) > 1:
        raise ModelLoadError(f"{path}: attention layers with different K/V head counts {attention_kv} are not supported")
    hidden = int(key("embedding_length"))
    n_heads = int(key("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // n_heads)
    common: dict[str, Any] = dict(
        vocab_size=embed_rows,
        hidden_size=hidden,
        layer_kinds=kinds,
        n_heads=n_heads,
        n_kv_heads=attention_kv[0] if attention_kv else n_heads,
        head_dim=head_dim,
        tie_word_embeddings="output.weight" not in tensor_names,
        rope_theta=float(key("rope.freq_base", 10000.0)),
    )
    if arch in ("lfm2", "lfm2moe"):
        moe = None
        if arch == "lfm2moe":
            if int(key("expert_gating_func", 2)) != 2:  # llama.cpp: 1 softmax, 2 sigmoid
                raise ModelLoadError(f"{path}: lfm2moe.expert_gating_func {key('expert_gating_func')}: expected 2 "
                                     "(sigmoid)")
            try:  # llama.cpp renormalises LFM2-MoE's chosen weights; its converter writes no scale (1.0)
                moe = lfm2_moe.moe_config(int(key("expert_count")), int(key("expert_used_count")),
                                          int(key("expert_feed_forward_length")),
                                          int(key("leading_dense_block_count", 0)), n_layers, norm=True,
                                          scaling=float(meta.get(f"{arch}.expert_weights_scale") or 1.0))
            except ValueError as e:
                raise ModelLoadError(f"{path}: {e}") from None
        return HybridConfig(
            architecture="lfm2_moe" if moe else "lfm2", **common,
            intermediate_size=int(key("feed_forward_length")),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
            max_position_embeddings=int(key("context_length", 128000)),
            rotary_dim=head_dim, qk_norm=True,
            conv_kernel=int(key("shortconv.l_cache")),
            conv_bias=any(n.endswith(".shortconv.conv.bias") for n in tensor_names),
            moe=moe,
        )
    return HybridConfig(
        architecture="granitemoehybrid", **common,
        intermediate_size=int(meta.get(f"{arch}.expert_shared_feed_forward_length") or key("feed_forward_length")),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(key("context_length", 2048)),
        rotary_dim=head_dim if meta.get(f"{arch}.rope.scaling.finetuned") else 0,
        attention_scale=float(key("attention.scale", head_dim**-0.5)),
        **gguf_mamba.mamba_fields(key, tensor_names, path),
        embedding_multiplier=float(key("embedding_scale", 1.0)),
        residual_multiplier=float(key("residual_scale", 1.0)),
        logits_scaling=float(key("logit_scale", 1.0)),
        moe=_granite_experts(meta, arch, path),
    )


def _granite_experts(meta: dict, arch: str, path: str) -> MoeConfig | None:
    """Granite-4.0-H's routed experts (top-k then softmax, as its HF config); None for a dense file."""
    n_experts = int(meta.get(f"{arch}.expert_count") or 0)
    if n_experts <= 0:
        return None
    gating = meta.get(f"{arch}.expert_gating_func")
    if gating not in (None, 1):  # llama.cpp: 1 softmax, 2 sigmoid
        raise ModelLoadError(f"{path}: expert gating function {gating} is not supported (expected 1, softmax)")
    size = meta.get(f"{arch}.expert_feed_forward_length") or meta.get(f"{arch}.feed_forward_length")
    top_k = meta.get(f"{arch}.expert_used_count")
    if size is None or top_k is None:
        raise ModelLoadError(f"{path}: metadata {arch}.expert_used_count or feed_forward_length is missing")
    return MoeConfig(n_experts=n_experts, top_k=int(top_k), expert_size=int(size), routing="topk_softmax",
                     norm_topk_prob=False)


def _canonical(arch: str, name: str, n_layers: int) -> str | None:
    global_names, layer_names = _NAMES[arch]
    if name in global_names:
        return global_names[name]
    if name.startswith("blk."):
        _, index, rest = name.split(".", 2)
        key = layer_names.get(rest) or moe_loading.gguf_layer_key(rest)  # experts: the MoE families' names
        if int(index) >= n_layers and arch in gguf_qwen35.GGUF_ARCHITECTURES:  # a next-token layer (mtp.py)
            key = "attn_norm" if key == "mixer_norm" else key or mtp.GGUF_NAMES.get(rest)
        if key is not None:
            return f"{index}.{key}"
    return None


def load_hybrid_gguf(path: str, stages, dtype: torch.dtype, cpu_experts: frozenset[int] = frozenset(),
                     int4_weights: bool = False) -> LoadedModel:
    """Load a hybrid GGUF; identity as in `engine.model.gguf_loading`. Tensors are read from the file one at a
    time and decoded by `engine.model.gguf_dequant` (bit for bit gguf's decoder); a type it does not decode (the
    IQ2 / IQ3 families) goes through gguf's own numpy decoder."""
    header = read_gguf_header(path)  # the lean reader: metadata values and the directory, no numpy views
    meta, directory, header_size = header.metadata, header.tensors, header.data_offset
    del header
    forget_headers()
    rows = next((t.shape[0] for t in directory if t.name == "token_embd.weight"), 0)
    config = hybrid_gguf_config(meta, {t.name for t in directory}, path, rows)
    arch = meta["general.architecture"]
    file_size = os.path.getsize(path)
    tensors = {}
    for t in directory:
        key = _canonical(arch, t.name, config.n_layers)
        if key is not None:
            tensors[key] = t
    # Layout checks for every tensor, type and size checks for those gguf_dequant decodes (gguf's decoder checks
    # the others' sizes as it reads them).
    check_gguf_tensors(path, directory, {k: t for k, t in tensors.items() if t.qtype in gguf_dequant.SUPPORTED})
    try:
        tokenizer = Tokenizer.from_gguf_metadata(meta)
    except TokenizerError as e:
        raise ModelLoadError(f"{path}: tokenizer: {e}") from None
    content = xxhash.xxh3_128()

    def read(t: GGUFTensor) -> torch.Tensor:
        """The tensor's bytes from the file, hashed into the fingerprint."""
        raw = torch.empty(t.n_bytes, dtype=torch.uint8)
        f.seek(t.offset)
        # numpy's stubs give ndarray the buffer protocol only from Python 3.12 on; it has it on 3.11 too.
        if f.readinto(memoryview(raw.numpy())) != t.n_bytes:  # type: ignore[arg-type]
            raise ModelLoadError(f"{path}: truncated: tensor {t.name} ends past the end of the file")
        content.update(raw.numpy())  # type: ignore[arg-type]  # a buffer (see above)
        return raw

    def blocks(key: str, want: torch.dtype) -> QuantEmbedding | None:
        """The embedding table as the file's blocks (quant_embedding.py), read where `get` would have read it."""
        t = tensors.get(key)
        if t is None or not gguf_dequant.is_blocked(t.qtype) or len(t.shape) != 2:
            return None
        content.update(key.encode())
        return QuantEmbedding(t.name, read(t), t.qtype, (t.shape[0], t.shape[1]), want)

    def decode(t: GGUFTensor) -> torch.Tensor:
        raw = read(t)
        if t.qtype in gguf_dequant.SUPPORTED:
            return gguf_dequant.dequantize(t.name, raw, t.qtype, t.shape)
        import gguf
        import numpy as np

        try:
            array = gguf.quants.dequantize(raw.numpy().reshape(*t.shape[:-1], -1), gguf.GGMLQuantizationType(t.qtype))
        except Exception as e:
            raise ModelLoadError(f"{path}: cannot read tensor {t.name} ({type(e).__name__}: {e})") from None
        return torch.from_numpy(np.array(array, dtype=np.float32)).view(t.shape)

    def get(key: str) -> torch.Tensor | None:
        if key.endswith(".gate_up") and ".experts." not in key:  # Granite's fused MLP input, split by the converter
            gate, up = get(key.removesuffix("gate_up") + "gate"), get(key.removesuffix("gate_up") + "up")
            return None if gate is None or up is None else torch.cat((gate, up))
        if key.endswith(".a_log"):  # the file has A = -exp(A_log) as [heads, 1]
            neg_a = get(key.removesuffix("a_log") + "neg_a")
            return None if neg_a is None else (-neg_a).log().reshape(-1)
        t = tensors.get(key)
        if t is None:
            return None
        content.update(key.encode())
        w = decode(t)
        if key.endswith(".conv") and w.dim() == 2:  # llama.cpp squeezes the depthwise conv to [channels, width]
            w = w.unsqueeze(1)
        elif key.endswith((".d_skip", ".ssm_norm")):
            w = w.reshape(-1)
        elif (arch == "granitehybrid" or arch in gguf_nemotron.ARCHITECTURES) and key.endswith((".q", ".k")):
            w = unpermute(w, config.n_heads if key.endswith(".q") else config.n_kv_heads)
        if arch in gguf_qwen35.GGUF_ARCHITECTURES:
            w = gguf_qwen35.fix(config, key, w)
        return w

    with open(path, "rb") as f:
        model = build_hybrid(config, stages, dtype, get, path, cpu_experts, int4_weights, blocks)
        # Qwen3-Next / Qwen3.5's next-token layers, kept as the file holds them (their norms already 1 + w, as the
        # block reads them), run by --spec mtp only.
        keys = list(tensors)
        model.mtp = tuple({key.split(".", 1)[1]: mtp.read_gguf_tensor(tensors[key], f, path) for key in found}
                          for found in mtp.layer_keys(config.n_layers, mtp.count_layers(config.n_layers, keys), keys))
    mtp.report_kept(model.mtp, path)
    h = xxhash.xxh3_128()
    h.update(struct.pack("<Q", file_size))
    with open(path, "rb") as f:
        h.update(f.read(header_size))
    h.update(content.digest())
    name = os.path.splitext(os.path.basename(path))[0]
    return LoadedModel(config, model, tokenizer, name, os.path.abspath(path), h.hexdigest(), dtype)  # type: ignore[arg-type]
