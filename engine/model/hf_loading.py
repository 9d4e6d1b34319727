"""HF model folders: config.json plus safetensors files (one, or sharded with an index)."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable

import torch
import xxhash

from engine.errors import ModelLoadError
from engine.model import moe_loading
from engine.model.build import LoadedModel, _build
from engine.model.config import ConfigError, ModelConfig
from engine.model.tokenizer import Tokenizer, TokenizerError

_HF_LAYER_NAMES = {
    "self_attn.q_proj.weight": "q", "self_attn.k_proj.weight": "k", "self_attn.v_proj.weight": "v",
    "self_attn.o_proj.weight": "o", "self_attn.q_proj.bias": "q_bias", "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias", "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
    "mlp.gate_proj.weight": "gate", "mlp.up_proj.weight": "up", "mlp.down_proj.weight": "down",
    "input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "mlp_norm",
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
        key = layer_names.get(rest) or moe_loading.hf_layer_key(rest)
        if key is not None:
            return f"{index}.{key}"
    return None


def _gemma_canonical(name: str) -> str | None:
    return _hf_canonical(name, _GEMMA_LAYER_NAMES)


def _is_norm(key: str) -> bool:
    return key == "norm" or key.endswith("_norm")


def _hybrid_loader(raw_config: dict):
    """The hybrid-model loader (engine.model.hybrid) when config.json names a hybrid architecture, else None."""
    from engine.model.hybrid.config import hf_hybrid_architecture

    if hf_hybrid_architecture(raw_config) is None:
        return None
    from engine.model.hybrid.loader import load_hybrid_hf

    return load_hybrid_hf


def _safetensors_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({e})") from None
        files = sorted(set(weight_map.values()))
        for name in files:
            if not os.path.isfile(os.path.join(folder, name)):
                raise ModelLoadError(f"{os.path.join(folder, name)}: listed in the index but missing")
        return [os.path.join(folder, n) for n in files]
    files = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no .safetensors files (and no model.safetensors.index.json)")
    return [os.path.join(folder, n) for n in files]


def _safetensors_header(path: str) -> bytes:
    """The 8-byte length and JSON header of a safetensors file; ModelLoadError if the file is short or bad."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelLoadError(f"{path}: truncated safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ModelLoadError(f"{path}: truncated safetensors file (header of {n} bytes, file of {size})")
        header = f.read(n)
    try:
        meta = json.loads(header)
    except ValueError:
        raise ModelLoadError(f"{path}: safetensors header is not valid JSON") from None
    end = max((v["data_offsets"][1] for k, v in meta.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise ModelLoadError(
            f"{path}: truncated safetensors file: tensors need {8 + n + end} bytes, the file has {size}"
        )
    return head + header


def _load_hf(folder: str, stages, dtype: torch.dtype, int4_weights: bool = False,
             cpu_experts: frozenset[int] = frozenset()) -> LoadedModel:

    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        raise ModelLoadError(f"{config_path}: missing (an HF model folder needs config.json)")
    try:
        with open(config_path, encoding="utf-8") as f:
            raw_config = json.load(f)
    except ValueError as e:
        raise ModelLoadError(f"{config_path}: not valid JSON ({e})") from None
    hybrid = _hybrid_loader(raw_config)
    if hybrid is not None:
        return hybrid(folder, raw_config, stages, dtype, cpu_experts, int4_weights)
    try:
        config = ModelConfig.from_hf(raw_config)
    except ConfigError as e:
        raise ModelLoadError(f"{config_path}: {e}") from None
    files = _safetensors_files(folder)
    h = _header_fingerprint(config.describe(), files)
    tokenizer = _folder_tokenizer(folder)
    handles, where = _open_tensors(files, _gemma_canonical if config.gemma else _hf_canonical)

    hashed: set[str] = set()

    def get(key: str, device: torch.device, want: torch.dtype) -> torch.Tensor | None:
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
        # Through float32 as before (exact for the float types a checkpoint holds), then to the compute dtype.
        if config.gemma and _is_norm(key):  # Gemma's norms scale by (1 + w), computed in float32 (as GGUF stores it)
            return (tensor.float() + 1.0).to(device=device, dtype=want)
        return tensor.float().to(device=device, dtype=want)

    if "lm_head" not in where and not config.tie_word_embeddings:
        raise ModelLoadError(f"{folder}: lm_head.weight is missing and config.json does not tie it to the embeddings")
    content = xxhash.xxh3_128()  # the weights' bytes, hashed as they are read for loading
    model = _build(config, stages, dtype, get, folder, int4_weights=int4_weights, cpu_experts=cpu_experts)
    h.update(content.digest())
    name = os.path.basename(os.path.normpath(folder))
    return LoadedModel(config, model, tokenizer, name, os.path.abspath(folder), h.hexdigest(), dtype)


def _header_fingerprint(description: dict, files: list[str]) -> xxhash.xxh3_128:
    """The start of a folder's fingerprint: the config, then each file's name, size and safetensors header (the
    weights' bytes are added as they are read)."""
    h = xxhash.xxh3_128()
    h.update(json.dumps(description, sort_keys=True).encode())
    for file in files:
        h.update(os.path.basename(file).encode())
        h.update(struct.pack("<Q", os.path.getsize(file)))
        h.update(_safetensors_header(file))
    return h


def _folder_tokenizer(folder: str) -> Tokenizer:
    try:
        return Tokenizer.from_hf_folder(folder)
    except TokenizerError as e:
        raise ModelLoadError(str(e)) from None


def _open_tensors(files: list[str], canonical: Callable[[str], str | None]) -> tuple[dict, dict[str, tuple[str, str]]]:
    """Each file opened once, and where each canonical weight key lives: {key: (file, tensor name)}."""
    from safetensors import safe_open

    handles = {}
    where: dict[str, tuple[str, str]] = {}
    for file in files:
        try:
            handle = safe_open(file, framework="pt")
        except Exception as e:
            raise ModelLoadError(f"{file}: not a readable safetensors file ({e})") from None
        handles[file] = handle
        for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
            key = canonical(name)
            if key is not None:
                where[key] = (file, name)
    return handles, where
