"""HF model folders: config.json plus safetensors files (one, or sharded with an index)."""

from __future__ import annotations

import json
import os

import torch
import xxhash

from engine.errors import ModelLoadError
from engine.model import mla_config, moe_loading, mtp, mxfp4
from engine.model.build import LoadedModel, build_model
from engine.model.config import ConfigError, ModelConfig, refuse_quantised
from engine.model.hf_files import folder_tokenizer, header_fingerprint, open_tensors, safetensors_files

_HF_LAYER_NAMES = {
    "self_attn.q_proj.weight": "q", "self_attn.k_proj.weight": "k", "self_attn.v_proj.weight": "v",
    "self_attn.o_proj.weight": "o", "self_attn.q_proj.bias": "q_bias", "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias", "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
    "mlp.gate_proj.weight": "gate", "mlp.up_proj.weight": "up", "mlp.down_proj.weight": "down",
    "input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "mlp_norm",
    "self_attn.o_proj.bias": "o_bias", "self_attn.sinks": "sinks",  # gpt-oss
}
_HF_GLOBAL_NAMES = {"model.embed_tokens.weight": "embed", "model.norm.weight": "norm", "lm_head.weight": "lm_head"}


# Gemma's post_attention_layernorm normalises the attention output; its pre_feedforward_layernorm is the
# MLP's input norm (what post_attention_layernorm is in the Llama family).
_GEMMA_LAYER_NAMES = {
    **_HF_LAYER_NAMES, "post_attention_layernorm.weight": "post_attn_norm",
    "pre_feedforward_layernorm.weight": "mlp_norm", "post_feedforward_layernorm.weight": "post_mlp_norm",
}


def _hf_canonical(name: str, layer_names: dict[str, str] = _HF_LAYER_NAMES) -> str | None:
    if name in _HF_GLOBAL_NAMES:
        return _HF_GLOBAL_NAMES[name]
    if name.startswith("model.layers."):
        _, _, index, rest = name.split(".", 3)
        key = (layer_names.get(rest) or moe_loading.hf_layer_key(rest) or mtp.HF_NAMES.get(rest)
               or mla_config.HF_NAMES.get(rest))
        if key is not None:
            return f"{index}.{key}"
    return None


def _gemma_canonical(name: str) -> str | None:
    return _hf_canonical(name, _GEMMA_LAYER_NAMES)


# Gemma 4: the per-layer inputs' tensors (model-wide and per layer) and each layer's output scalar.
_GEMMA4_GLOBAL_NAMES = {"model.embed_tokens_per_layer.weight": "ple_embed",
                        "model.per_layer_model_projection.weight": "ple_model_proj",
                        "model.per_layer_projection_norm.weight": "ple_proj_norm"}
_GEMMA4_LAYER_NAMES = {**_GEMMA_LAYER_NAMES, "per_layer_input_gate.weight": "ple_gate",
                       "per_layer_projection.weight": "ple_proj", "post_per_layer_input_norm.weight": "ple_norm",
                       "layer_scalar": "layer_scalar", "router.proj.weight": "router", "router.scale": "router_scale",
                       "router.per_expert_scale": "expert_scale", "experts.gate_up_proj": "experts.gate_up",
                       "experts.down_proj": "experts.down", "post_feedforward_layernorm_1.weight": "post_mlp_norm_1",
                       "pre_feedforward_layernorm_2.weight": "experts_norm",
                       "post_feedforward_layernorm_2.weight": "post_experts_norm"}


def _gemma4_canonical(name: str) -> str | None:
    return _GEMMA4_GLOBAL_NAMES.get(name) or _hf_canonical(name, _GEMMA4_LAYER_NAMES)


def _canonical_names(config: ModelConfig):
    if config.architecture == "gemma4":
        return _gemma4_canonical
    return _gemma_canonical if config.gemma else _hf_canonical


def _is_norm(key: str) -> bool:
    return key == "norm" or key.endswith("_norm")


def _kept(file: str, name: str, handles) -> mtp.KeptTensor:
    try:
        tensor = handles[file].get_tensor(name)
    except Exception as e:
        raise ModelLoadError(f"{file}: cannot read tensor {name} ({e})") from None
    return mtp.KeptTensor(name, str(tensor.dtype), tuple(tensor.shape), tensor)


def hybrid_loader(raw_config: dict):
    """The hybrid-model loader (engine.model.hybrid) when config.json names a hybrid architecture, else None."""
    from engine.model.hybrid.config import hf_hybrid_architecture

    if hf_hybrid_architecture(raw_config) is None:
        return None
    from engine.model.hybrid.loader import load_hybrid_hf

    return load_hybrid_hf


def load_hf(folder: str, stages, dtype: torch.dtype, int4_weights: bool = False,
             cpu_experts: frozenset[int] = frozenset()) -> LoadedModel:

    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        raise ModelLoadError(f"{config_path}: missing (an HF model folder needs config.json)")
    try:
        with open(config_path, encoding="utf-8") as f:
            raw_config = json.load(f)
    except ValueError as e:
        raise ModelLoadError(f"{config_path}: not valid JSON ({e})") from None
    if not isinstance(raw_config, dict):
        raise ModelLoadError(f"{config_path}: expected a JSON object, got {type(raw_config).__name__}")
    hybrid = hybrid_loader(raw_config)
    if hybrid is not None:
        try:
            refuse_quantised(raw_config, None)  # before the hybrid reader, which casts what it reads to float
        except ConfigError as e:
            raise ModelLoadError(f"{config_path}: {e}") from None
        return hybrid(folder, raw_config, stages, dtype, cpu_experts, int4_weights)
    try:
        config = ModelConfig.from_hf(raw_config)
    except ConfigError as e:
        raise ModelLoadError(f"{config_path}: {e}") from None
    files = safetensors_files(folder)
    h = header_fingerprint(config.describe(), files)
    tokenizer = folder_tokenizer(folder)
    handles, where = open_tensors(files, _canonical_names(config))

    hashed: set[str] = set()
    gpt_oss = config.architecture == "gpt_oss"

    def read(key: str) -> torch.Tensor | None:
        """The checkpoint's tensor of a canonical key as stored (its bytes hashed on the first read), or None."""
        found = where.get(key)
        if found is None:
            return None
        file, name = found
        try:
            tensor = handles[file].get_tensor(name)
        except Exception as e:
            raise ModelLoadError(f"{file}: cannot read tensor {name} ({e})") from None
        if key not in hashed:
            hashed.add(key)
            content.update(key.encode())
            content.update(tensor.reshape(-1).view(torch.uint8).numpy())
        return tensor

    # A released gpt-oss checkpoint's experts are MXFP4 blocks (mxfp4.py): decoded, or kept as they are.
    experts = mxfp4.CheckpointExperts(read) if gpt_oss and any(k.endswith("_blocks") for k in where) else None

    def get(key: str, device: torch.device, want: torch.dtype) -> torch.Tensor | None:
        try:
            decoded = experts.get(key) if experts is not None else None
        except ValueError as e:
            raise ModelLoadError(f"{folder}: {e}") from None
        if decoded is not None:
            return decoded.to(device=device, dtype=want)
        tensor = read(key)
        if tensor is None:
            return None
        if not tensor.is_floating_point() or tensor.element_size() < 2:  # FP8, int8 codes: values need scales
            file, name = where[key]
            raise ModelLoadError(f"{file}: tensor {name} is {str(tensor.dtype).removeprefix('torch.')}; expected "
                                 "float32, float16 or bfloat16 weights (a quantised checkpoint is not read)")
        if gpt_oss:  # its experts' own layout (moe_loading.gpt_oss_hf_layout)
            tensor = moe_loading.gpt_oss_hf_layout(key, tensor)
        # Through float32 as before (exact for the float types a checkpoint holds), then to the compute dtype.
        if config.norm_offset and _is_norm(key):  # Gemma 3's norms scale by (1 + w), in float32 (as GGUF stores it)
            return (tensor.float() + 1.0).to(device=device, dtype=want)
        return tensor.float().to(device=device, dtype=want)

    if "lm_head" not in where and not config.tie_word_embeddings:
        raise ModelLoadError(f"{folder}: lm_head.weight is missing and config.json does not tie it to the embeddings")
    content = xxhash.xxh3_128()  # the weights' bytes, hashed as they are read for loading
    model = build_model(config, stages, dtype, get, folder, int4_weights=int4_weights, cpu_experts=cpu_experts,
                        kquant=experts.kquant if experts is not None else None)
    h.update(content.digest())
    # GLM's next-token layers: kept as the checkpoint holds them, not part of the running model (mtp.py).
    kept = mtp.layer_keys(config.n_layers, config.mtp_layers, list(where))
    model.mtp = tuple({key.split(".", 1)[1]: _kept(*where[key], handles) for key in keys} for keys in kept)
    mtp.report_kept(model.mtp, folder)
    name = os.path.basename(os.path.normpath(folder))
    return LoadedModel(config, model, tokenizer, name, os.path.abspath(folder), h.hexdigest(), dtype)


