"""Hybrid models from GGUF files, with llama.cpp's tensor names and metadata keys.

Supported: `lfm2` (llama.cpp's LFM2: `shortconv.*` tensors, the final norm stored as `token_embd_norm`,
`attention.head_count_kv` per layer with 0 for the convolution layers, `shortconv.l_cache`). llama.cpp's
`qwen35` and `granitehybrid` files are refused with a clear error for now: their converter rewrites
several tensors (A = -exp(A_log), norms with the +1 folded in, reordered value heads) and matching that
needs its own parity test.
"""

from __future__ import annotations

import os
import struct

import torch
import xxhash

from engine.errors import ModelLoadError
from engine.model.hybrid.config import ATTENTION, SHORT_CONV, HybridConfig
from engine.model.hybrid.loader import build_hybrid
from engine.model.loader import LoadedModel, _read_gguf, gguf_metadata, read_gguf
from engine.model.tokenizer import Tokenizer, TokenizerError

GGUF_ARCHITECTURES = ("lfm2",)
NOT_YET = ("qwen35", "qwen3next", "granitehybrid", "nemotron_h", "falcon-h1", "lfm2moe")

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


def is_hybrid_gguf(meta: dict) -> bool:
    """The file's architecture is a hybrid one (supported, or refused with a reason by `hybrid_gguf_config`)."""
    arch = meta.get("general.architecture")
    return arch in GGUF_ARCHITECTURES or arch in NOT_YET


def hybrid_gguf_config(meta: dict, tensor_names: set[str], path: str) -> HybridConfig:
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: GGUF architecture {arch!r} (a hybrid model) is not supported from GGUF yet; "
            f"load its Hugging Face folder instead (GGUF hybrids supported: {', '.join(GGUF_ARCHITECTURES)})"
        )

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
    kinds = tuple(ATTENTION if n else SHORT_CONV for n in kv_per_layer)
    attention_kv = sorted({n for n in kv_per_layer if n})
    if len(attention_kv) > 1:
        raise ModelLoadError(f"{path}: attention layers with different K/V head counts {attention_kv} are not supported")
    hidden = int(key("embedding_length"))
    n_heads = int(key("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // n_heads)
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or ())
    return HybridConfig(
        architecture="lfm2",
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        layer_kinds=kinds,
        n_heads=n_heads,
        n_kv_heads=attention_kv[0] if attention_kv else n_heads,
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(key("context_length", 128000)),
        tie_word_embeddings="output.weight" not in tensor_names,
        rope_theta=float(key("rope.freq_base", 1000000.0)),
        rotary_dim=head_dim,
        qk_norm=True,
        conv_kernel=int(key("shortconv.l_cache")),
        conv_bias="blk.0.shortconv.conv.bias" in tensor_names,
    )


def _canonical(name: str) -> str | None:
    if name in _LFM2_GLOBAL_NAMES:
        return _LFM2_GLOBAL_NAMES[name]
    if name.startswith("blk."):
        _, index, rest = name.split(".", 2)
        key = _LFM2_LAYER_NAMES.get(rest)
        if key is not None:
            return f"{index}.{key}"
    return None


def load_hybrid_gguf(path: str, stages, dtype: torch.dtype) -> LoadedModel:
    """Load a hybrid GGUF (any quantisation gguf can dequantise); identity as in `engine.model.loader`."""
    import gguf
    import numpy as np

    reader = read_gguf(path)
    meta = gguf_metadata(reader)
    config = hybrid_gguf_config(meta, {t.name for t in reader.tensors}, path)
    file_size = os.path.getsize(path)
    tensors = {}
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > file_size:
            raise ModelLoadError(f"{path}: truncated: tensor {t.name} ends past the end of the file")
        key = _canonical(t.name)
        if key is not None:
            tensors[key] = t
    try:
        tokenizer = Tokenizer.from_gguf_metadata(meta)
    except TokenizerError as e:
        raise ModelLoadError(f"{path}: tokenizer: {e}") from None
    content = xxhash.xxh3_128()

    def get(key: str) -> torch.Tensor | None:
        t = tensors.get(key)
        if t is None:
            return None
        content.update(key.encode())
        content.update(t.data)
        try:
            array = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise ModelLoadError(f"{path}: cannot read tensor {t.name} ({type(e).__name__}: {e})") from None
        w = torch.from_numpy(np.array(array, dtype=np.float32))
        if key.endswith(".conv") and w.dim() == 2:  # llama.cpp squeezes the depthwise conv to [channels, width]
            w = w.unsqueeze(1)
        return w

    model = build_hybrid(config, stages, dtype, get, path)
    h = xxhash.xxh3_128()
    h.update(struct.pack("<Q", file_size))
    with open(path, "rb") as f:
        h.update(f.read(reader.data_offset))
    h.update(content.digest())
    _read_gguf.cache_clear()  # drop the file mapping (Windows cannot replace a mapped file)
    name = os.path.splitext(os.path.basename(path))[0]
    return LoadedModel(config, model, tokenizer, name, os.path.abspath(path), h.hexdigest(), dtype)  # type: ignore[arg-type]
