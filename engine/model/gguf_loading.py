"""GGUF files: the header and tensor directory, metadata -> ModelConfig, and the tensors (dequantised or as
4-bit groups) handed to the model builder."""

from __future__ import annotations

import os
import struct

import torch
import xxhash
from gguf import GGMLQuantizationType

from engine.errors import ModelLoadError
from engine.model import families, gguf_dequant, kquant_weight, mla_config, moe_loading, mtp
from engine.model.build import Groups, LoadedModel, build_model
from engine.model.config import ModelConfig
from engine.model.gemma import GEMMA_CHAT_TEMPLATE, gguf_gemma_fields
from engine.model.gemma4 import gguf_gemma4_fields
from engine.model.gguf_header import forget_headers, read_gguf_header
from engine.model.gguf_tensors import check_gguf_tensors, unpermute
from engine.model.quant_embedding import QuantEmbedding
from engine.model.read_staging import OrderedHash, ReadStaging
from engine.model.sliding import gguf_sliding_layers
from engine.model.tokenizer import Tokenizer, TokenizerError
from engine.model.weights_cache import DerivedWeights, KeptTokenizer

_GGUF_LAYER_NAMES = {
    "attn_q.weight": "q", "attn_k.weight": "k", "attn_v.weight": "v", "attn_output.weight": "o",
    "attn_q.bias": "q_bias", "attn_k.bias": "k_bias", "attn_v.bias": "v_bias",
    "attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm",
    "ffn_gate.weight": "gate", "ffn_up.weight": "up", "ffn_down.weight": "down",
    "attn_norm.weight": "attn_norm", "ffn_norm.weight": "mlp_norm",
    "post_attention_norm.weight": "post_attn_norm", "post_ffw_norm.weight": "post_mlp_norm",  # Gemma 3
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "embed", "output_norm.weight": "norm", "output.weight": "lm_head", "rope_freqs.weight": "rope_freqs",
}


# GLM-4.x MoE's post_attention_norm is its MLP's input norm (llama.cpp names its post_attention_layernorm so),
# not Gemma's norm of the attention output.
_GLM4_MOE_LAYER_NAMES = {**_GGUF_LAYER_NAMES, "post_attention_norm.weight": "mlp_norm"}
# Gemma 4: each layer's output scalar and its per-layer input's gate, projection and norm; the model-wide
# per-layer table, projection and norm.
_GEMMA4_LAYER_NAMES = {**_GGUF_LAYER_NAMES, "layer_output_scale.weight": "layer_scalar", "inp_gate.weight": "ple_gate",
                       "proj.weight": "ple_proj", "post_norm.weight": "ple_norm",
                       # the expert block beside the MLP (gemma4_experts.py), as llama.cpp's converter names it
                       "ffn_gate_inp.weight": "router", "ffn_gate_inp.scale": "router_scale",
                       "ffn_down_exps.scale": "expert_scale", "ffn_gate_up_exps.weight": "experts.gate_up",
                       "ffn_down_exps.weight": "experts.down", "pre_ffw_norm_2.weight": "experts_norm",
                       "post_ffw_norm_1.weight": "post_mlp_norm_1", "post_ffw_norm_2.weight": "post_experts_norm"}
_GEMMA4_GLOBAL_NAMES = {"per_layer_token_embd.weight": "ple_embed", "per_layer_model_proj.weight": "ple_model_proj",
                        "per_layer_proj_norm.weight": "ple_proj_norm"}
# gpt-oss's too (llama.cpp's GPT_OSS tensor list has ATTN_POST_NORM, not FFN_NORM), with its sinks and o bias.
_GPT_OSS_LAYER_NAMES = {**_GLM4_MOE_LAYER_NAMES, "attn_output.bias": "o_bias", "attn_sinks.weight": "sinks"}
_LAYER_NAMES = {"glm4moe": _GLM4_MOE_LAYER_NAMES, "gpt-oss": _GPT_OSS_LAYER_NAMES, "gemma4": _GEMMA4_LAYER_NAMES}


def _gguf_canonical(name: str, arch: str | None = None) -> str | None:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    if arch == "gemma4" and name in _GEMMA4_GLOBAL_NAMES:
        return _GEMMA4_GLOBAL_NAMES[name]
    if name.startswith("blk."):
        _, index, rest = name.split(".", 2)
        layer_names = _LAYER_NAMES.get(arch or "", _GGUF_LAYER_NAMES)
        key = (layer_names.get(rest) or moe_loading.gguf_layer_key(rest) or mtp.GGUF_NAMES.get(rest)
               or mla_config.GGUF_NAMES.get(rest))
        if key is not None:
            return f"{index}.{key}"
    return None


def gguf_config(meta: dict, tensor_names: set[str], path: str) -> ModelConfig:
    arch = meta.get("general.architecture")
    moe_arch = moe_loading.gguf_architecture(arch, meta)  # mixture-of-experts families
    if arch not in families.gguf_architectures("dense") and moe_arch is None:
        raise ModelLoadError(f"{path}: unknown architecture {arch!r}; expected "
                             f"{', '.join(families.gguf_architectures('dense', 'moe'))}")
    assert isinstance(arch, str)  # a dense name above, or a name gguf_architecture knows

    def key(name: str, default=None):
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"{path}: metadata {arch}.{name} is missing")
        return value

    def whole(name: str, default=None) -> int:
        """A positive whole-number field, ModelLoadError naming it otherwise."""
        value = key(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ModelLoadError(f"{path}: metadata {arch}.{name} is {value!r}; expected a positive whole number")
        return value

    hidden = whole("embedding_length")
    n_heads = whole("attention.head_count")
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or ())
    scaling = None
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind and kind != "none":
        scaling = {"rope_type": kind, "factor": float(key("rope.scaling.factor"))}
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        for name, field in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                            ("yarn_attn_factor", "attention_factor")):
            value = meta.get(f"{arch}.rope.scaling.{name}")
            if kind == "yarn" and value is not None:
                scaling[field] = float(value)
        if kind == "yarn" and arch == "gpt-oss":
            # gpt-oss was trained with YaRN's ramp unrounded (transformers' truncate: false, GptOssConfig's
            # default); llama.cpp rounds its ends. The file cannot say which; the model's own holds.
            scaling["truncate"] = False
    n_kv = key("attention.head_count_kv", n_heads)
    # GLM's block_count includes its next-token (MTP) layers after the decoder layers (llama.cpp's converter).
    # GLM-4.7-Flash's deepseek2 files too (conversion/glm.py's Glm4MoeLiteModel).
    mtp_layers = int(meta.get(f"{arch}.nextn_predict_layers") or 0) if arch in ("glm4moe", "deepseek2") else 0
    n_layers = whole("block_count") - mtp_layers
    if mtp_layers and "blk.0.attn_norm.weight" not in tensor_names:  # llama.cpp's convert_hf_to_gguf --mtp-only
        raise ModelLoadError(f"{path}: holds only the next-token (MTP) layer, not the model (a file written with "
                             "--mtp-only); load the model's own GGUF")
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // n_heads)
    rotary_dim = int(meta.get(f"{arch}.rope.dimension_count") or head_dim) if arch == "glm4moe" else head_dim
    moe = moe_arch and moe_loading.gguf_moe_config(moe_arch, arch, meta, tensor_names, n_layers, path)
    mla = None
    if arch == "deepseek2":  # latent attention: one K/V head of the RoPE width holds the latent (mla_config.py)
        if scaling is not None and meta.get(f"{arch}.rope.scaling.yarn_log_multiplier"):
            # the converter writes 0.1 x mscale_all_dim; DeepSeek-V3's mscale equals it
            scaling["mscale"] = scaling["mscale_all_dim"] = float(meta[f"{arch}.rope.scaling.yarn_log_multiplier"]) / 0.1
        try:
            mla = mla_config.mla_from_gguf(meta, arch, scaling)
        except ValueError as e:
            raise ModelLoadError(f"{path}: {e}") from None
        n_kv, head_dim, rotary_dim = 1, mla.qk_rope_head_dim, mla.qk_rope_head_dim
    try:
        window, sliding = gguf_sliding_layers(arch, meta, n_layers)
        gemma = (gguf_gemma_fields(arch, meta, n_layers, hidden, n_heads)
                 or gguf_gemma4_fields(arch, meta, tensor_names, n_layers, int(vocab)))
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    # Gemma 4 gives the sliding layers' head shape as the model's, the global layers' apart.
    head_dim = gemma.pop("head_dim", None) or head_dim
    n_kv = gemma.pop("n_kv_heads", None) or n_kv
    rotary_dim = rotary_dim if arch == "glm4moe" else head_dim
    ff = key("feed_forward_length")
    return ModelConfig(
        architecture=moe_arch or arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(ff[0] if isinstance(ff, list) else ff),  # a list: one per layer (all equal: gemma4)
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(n_kv if not isinstance(n_kv, list) else n_kv[0]),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(key("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        moe=moe or None,
        sliding_window=window,
        sliding_layers=sliding,
        rotary_dim=None if rotary_dim == head_dim else rotary_dim,
        mtp_layers=mtp_layers,
        mla=mla,
        **gemma,
    )


def load_gguf(path: str, stages, dtype: torch.dtype, int4_weights: bool = False,
               cpu_experts: frozenset[int] = frozenset(), weights_cache_dir: str | None = None) -> LoadedModel:
    header = read_gguf_header(path)  # the lean reader: metadata values and the directory, no numpy views
    meta = header.metadata
    from engine.model.hybrid.gguf_loader import is_hybrid_gguf, load_hybrid_gguf

    if is_hybrid_gguf(meta):
        return load_hybrid_gguf(path, stages, dtype, cpu_experts, int4_weights)
    directory = header.tensors
    header_size = header.data_offset
    del header
    forget_headers()
    tensors = {}
    arch = meta.get("general.architecture")
    for t in directory:
        key = _gguf_canonical(t.name, arch)
        if key is not None:
            tensors[key] = t
    config = gguf_config(meta, {t.name for t in directory}, path)
    file_size = os.path.getsize(path)
    check_gguf_tensors(path, directory, tensors)
    kept_tokenizer = KeptTokenizer(weights_cache_dir, path, header_size) if weights_cache_dir else None
    kept = kept_tokenizer.load() if kept_tokenizer is not None else None
    try:
        tokenizer = Tokenizer.from_gguf_metadata(meta, kept)
    except TokenizerError as e:
        raise ModelLoadError(f"{path}: tokenizer: {e}") from None
    if kept_tokenizer is not None and kept is None:
        kept_tokenizer.save(tokenizer.backend, tokenizer.fingerprint)
    if config.architecture == "gemma3" and not tokenizer.chat_template:  # llama.cpp's gemma3 files have none
        tokenizer.chat_template = GEMMA_CHAT_TEMPLATE
    # llama.cpp permutes q/k only for the llama architecture and its subclasses (families.py).
    permuted = families.BY_NAME[config.architecture].gguf_permuted_qk
    content = OrderedHash()  # the weights' bytes, hashed as they are read for loading, each tensor once
    hashed: set[str] = set()

    staging: dict[torch.device, ReadStaging] = {}

    def raw(key: str, device: torch.device) -> torch.Tensor:
        """The tensor's bytes, read from the file (not through the reader's mapping, whose pages would stay
        resident next to the converted weights) onto `device`: onto a CUDA device through pinned pieces."""
        t = tensors[key]
        first = key not in hashed
        if first:
            hashed.add(key)
            content.add(key.encode())
        if device.type == "cuda":
            reader = staging.get(device) or staging.setdefault(device, ReadStaging(device))
            on_device = reader.read(f, t.offset, t.n_bytes,
                                    lambda piece: content.add(piece.numpy()) if first else None)
            if on_device is None:
                raise ModelLoadError(f"{path}: truncated: tensor {t.name} ends past the end of the file")
            return on_device
        data = torch.empty(t.n_bytes, dtype=torch.uint8)
        f.seek(t.offset)
        # numpy's stubs give ndarray the buffer protocol only from Python 3.12 on; it has it on 3.11 too.
        if f.readinto(memoryview(data.numpy())) != data.numel():  # type: ignore[arg-type]
            raise ModelLoadError(f"{path}: truncated: tensor {t.name} ends past the end of the file")
        if first:
            content.add(data.numpy())
        return data.to(device)

    def get(key: str, device: torch.device, want: torch.dtype) -> torch.Tensor | None:
        t = tensors.get(key)
        if t is None:
            return None
        w = gguf_dequant.dequantize(t.name, raw(key, device), t.qtype, t.shape, want)
        if permuted and key.endswith((".q", ".k", ".q_bias", ".k_bias")):
            w = unpermute(w, config.n_heads if ".q" in key else config.n_kv_heads)
        return w

    def q4(key: str) -> Groups | None:
        t = tensors.get(key)
        if t is None or t.qtype not in gguf_dequant.Q4_GROUPED or len(t.shape) not in (2, 3):  # 3-D: experts
            return None
        found = gguf_dequant.q4_groups(t.name, raw(key, torch.device("cpu")), t.qtype, t.shape)
        if permuted and key.endswith((".q", ".k")):
            heads = config.n_heads if key.endswith(".q") else config.n_kv_heads
            found = tuple(unpermute(x, heads) for x in found)
        return found

    def kquant(keys: list[str], kinds: tuple[str, ...]) -> tuple[str, list[torch.Tensor]] | None:
        """Tensors the file holds in one block type of `kinds` (keys of kquant_weight.CLASSES), where the native
        kernels multiply such rows as they are: (that type, each one's bytes [..., rows, row bytes], q/k rows in
        this engine's order); None, reading nothing, otherwise."""
        found = [tensors.get(key) for key in keys]
        names = {GGMLQuantizationType(t.qtype).name if t is not None else "" for t in found}
        kind = names.pop() if len(names) == 1 else ""
        if kind not in kinds or kind not in kquant_weight.CLASSES or not kquant_weight.available():
            return None
        out = []
        for key, t in zip(keys, found, strict=True):
            assert t is not None  # its type is in kinds
            b = raw(key, torch.device("cpu")).view(*t.shape[:-1], kquant_weight.row_bytes(t.shape[-1], kind))
            if permuted and key.endswith((".q", ".k")):
                b = unpermute(b, config.n_heads if key.endswith(".q") else config.n_kv_heads)
            out.append(b)
        return kind, out

    def wide(key: str) -> bool:
        t = tensors.get(key)
        return t is not None and t.qtype in gguf_dequant.WIDE

    def blocks(key: str, want: torch.dtype) -> QuantEmbedding | None:
        t = tensors.get(key)
        if t is None or not gguf_dequant.is_blocked(t.qtype) or len(t.shape) != 2:
            return None
        return QuantEmbedding(t.name, raw(key, torch.device("cpu")), t.qtype, (t.shape[0], t.shape[1]), want)

    derived = None
    # Dense models on the CPU with 4-bit weights: the packed weights of an earlier start, or kept for the next.
    if weights_cache_dir and int4_weights and config.moe is None and all(torch.device(d).type == "cpu" for d, _, _ in stages):
        options = {"dtype": str(dtype), "stages": [[str(d), a, b] for d, a, b in stages]}
        derived = DerivedWeights(weights_cache_dir, path, header_size, options)
    try:
        with open(path, "rb") as f:
            model = build_model(config, stages, dtype, get, path, int4_weights=int4_weights, groups=q4, kquant=kquant,
                                wide=wide, cpu_experts=cpu_experts, blocks=blocks, derived=derived)
    finally:
        for reader in staging.values():
            reader.close()
        weights_hash = content.digest()  # waits for the hashing thread, which ends with it
    if derived is not None and derived.fingerprint is not None:
        fingerprint = derived.fingerprint  # the weights it replaced were not read: the first load's fingerprint
    else:
        h = xxhash.xxh3_128()
        h.update(struct.pack("<Q", file_size))
        with open(path, "rb") as f:
            h.update(f.read(header_size))  # header, metadata and tensor directory
        h.update(weights_hash)
        fingerprint = h.hexdigest()
        if derived is not None:
            derived.save(fingerprint)
    # GLM's next-token layers: kept as the file holds them (its bytes, its type), not run (mtp.py).
    with open(path, "rb") as f:
        model.mtp = tuple({key.split(".", 1)[1]: mtp.read_gguf_tensor(tensors[key], f, path) for key in keys}
                          for keys in mtp.layer_keys(config.n_layers, config.mtp_layers, list(tensors)))
    mtp.report_kept(model.mtp, path)
    name = os.path.splitext(os.path.basename(path))[0]
    return LoadedModel(config, model, tokenizer, name, os.path.abspath(path), fingerprint, dtype)
