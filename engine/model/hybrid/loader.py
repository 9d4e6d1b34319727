"""Hybrid models from HF folders (config.json + safetensors): the family registry and the generic builder.

A family module (lfm2, lfm2_moe, qwen3_5, granitemoehybrid, qwen3_next, qwen3_5_moe, nemotron_h, falcon_h1) provides `config_from_hf(cfg) -> HybridConfig`, the
map of its HF tensor names to canonical keys (`HF_LAYER_NAMES` after "model.layers.<i>.", `HF_GLOBAL_NAMES`),
`build_mixer(config, layer, need, opt, to)` for its recurrent layers and `NORM_OFFSET` (Qwen3.5 stores
RMSNorm weights as w - 1, so 1 is added once at load). Attention layers and the MLP are built here: dense, or
the sparse expert block (`moe_mlp`) on the layers `HybridConfig.moe` marks.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch
import xxhash

from engine import startup_progress
from engine.errors import ModelLoadError
from engine.model import int4, moe_loading, mtp, q8_output
from engine.model.build import LoadedModel
from engine.model.hf_files import folder_tokenizer, header_fingerprint, open_tensors, safetensors_files
from engine.model.hybrid import (
    falcon_h1,
    granitemoehybrid,
    int4_layers,
    lfm2,
    lfm2_moe,
    moe_mlp,
    nemotron_h,
    qwen3_5,
    qwen3_5_moe,
    qwen3_next,
)
from engine.model.hybrid.attention import AttentionMixer
from engine.model.hybrid.config import ATTENTION, ConfigError, HybridConfig, hf_hybrid_architecture
from engine.model.hybrid.model import HybridCausalLM, HybridLayer
from engine.model.q8_output import Q8Output
from engine.model.quant_embedding import BlocksGetter, QuantEmbedding, kept_table

FAMILIES: dict[str, ModuleType] = {"lfm2": lfm2, "qwen3_5": qwen3_5, "granitemoehybrid": granitemoehybrid}
FAMILIES |= {"qwen3_next": qwen3_next, "qwen3_5_moe": qwen3_5_moe}
FAMILIES |= {"nemotron_h": nemotron_h, "falcon_h1": falcon_h1, "lfm2_moe": lfm2_moe}
# Wrappers around the text model (Qwen3.5's vision-language checkpoints) and parts the text model does not use.
_PREFIXES = (("model.language_model.", "model."), ("backbone.", "model."))  # backbone.: Nemotron-H
_SKIPPED_PREFIXES = ("model.visual.", "mtp.", "model.vision")
# The families whose folders carry a next-token layer (`mtp.*`) that `--spec mtp` runs (engine/model/mtp.py).
MTP_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


def hybrid_config_from_hf(cfg: dict) -> HybridConfig:
    """HybridConfig from a parsed config.json (a VLM wrapper's `text_config` is used when present)."""
    arch = hf_hybrid_architecture(cfg)
    if arch is None:
        raise ConfigError(f"not a hybrid model this engine runs (architectures {cfg.get('architectures')})")
    text = cfg.get("text_config")
    if isinstance(text, dict):
        merged = dict(text)
        merged.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
        cfg = merged
    try:
        return FAMILIES[arch].config_from_hf(cfg)
    except KeyError as e:
        raise ConfigError(f"config.json lacks {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"config.json has a malformed value: {e}") from None


def build_hybrid(
    config: HybridConfig, stages: list[tuple[torch.device, int, int]], dtype: torch.dtype, get, path: str,
    cpu_experts: frozenset[int] = frozenset(), int4_weights: bool = False, blocks: BlocksGetter | None = None,
) -> HybridCausalLM:
    """The model on `stages` from `get(canonical key) -> CPU tensor | None`; the routed experts of the layers in
    `cpu_experts` stay in host RAM as 4-bit groups (engine/model/moe_placement.py). `int4_weights`
    (`--cpu-weights int4`, float32 on the CPU): each layer's projections and the output matrix become 4-bit
    groups as they are built (engine/model/hybrid/int4_layers.py). `blocks` gives the embedding table as a GGUF
    file's quantised blocks (engine/model/quant_embedding.py), kept so on the CPU unless the output matrix is that
    float table."""
    assert not int4_weights or dtype == torch.float32, "int4 weights take float32 activations"
    c = config
    if not stages or stages[0][1] != 0 or stages[-1][2] != c.n_layers:
        raise ModelLoadError(f"{path}: stages {stages} do not cover the model's {c.n_layers} layers")
    family = FAMILIES[c.architecture]
    offset = float(getattr(family, "NORM_OFFSET", 0.0))

    def opt(key: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        t = get(key)
        if t is not None and tuple(t.shape) != shape:
            raise ModelLoadError(f"{path}: weight {key!r} has shape {tuple(t.shape)}, expected {shape}")
        return t

    def need(key: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = opt(key, shape)
        if t is None:
            raise ModelLoadError(f"{path}: weight {key!r} is missing")
        return t

    def norm(key: str, size: int) -> torch.Tensor:
        return need(key, (size,)) + offset

    d, hd = c.hidden_size, c.head_dim
    q_rows = c.n_heads * hd * (2 if c.attention_gate else 1)
    kv_rows = c.n_kv_heads * hd
    first_device, last_device = torch.device(stages[0][0]), torch.device(stages[-1][0])
    # Tied and int4: the 4-bit output matrix is built from the blocks' rows (the packing takes whole row groups).
    tied_int4_packable = int4.can_pack(c.vocab_size + -c.vocab_size % int4_layers.ROW_MULTIPLE, d)
    float_output = c.tie_word_embeddings and not (int4_weights and tied_int4_packable)
    table = kept_table(blocks, first_device, dtype, (c.vocab_size, d), path, float_output=float_output)
    embed_cpu = need("embed", (c.vocab_size, d)) if table is None else None
    layers: list[torch.nn.Module] = []
    for device, a, b in stages:
        device = torch.device(device)

        def to(t: torch.Tensor, device: torch.device = device) -> torch.Tensor:
            return t.to(device=device, dtype=dtype).contiguous()

        for li in range(a, b):
            p = f"{li}."
            kind = c.layer_kinds[li]
            if kind == ATTENTION:
                wqkv = torch.cat((need(p + "q", (q_rows, d)), need(p + "k", (kv_rows, d)), need(p + "v", (kv_rows, d))))
                mixer: torch.nn.Module = AttentionMixer(
                    c, c.attention_layers.index(li), wqkv=to(wqkv), wo=to(need(p + "o", (d, c.n_heads * hd))),
                    q_norm=to(norm(p + "q_norm", hd)) if c.qk_norm else None,
                    k_norm=to(norm(p + "k_norm", hd)) if c.qk_norm else None,
                )
            else:
                mixer = family.build_mixer(c, li, need, opt, to)
            # A family with layers of another structure builds them (engine/model/hybrid/blocks.py); None: the usual.
            built = family.build_layer(c, li, mixer, get, need, norm, to, path) if hasattr(family, "build_layer") else None
            if built is not None:
                layers.append(_int4(built) if int4_weights else built)
                startup_progress.report(len(layers), c.n_layers)
                continue
            inter = c.intermediate_size
            moe = moe_mlp.build(c, li, get, need, to, path, dtype, cpu_experts)  # None: a dense MLP
            mlp = {"moe": moe} if moe is not None else {
                "w_gate_up": to(family.gate_up(c, li, need) if hasattr(family, "gate_up") else torch.cat(
                    (need(p + "gate", (inter, d)), need(p + "up", (inter, d))))),
                "w_down": to(need(p + "down", (d, inter))),
            }
            layer = HybridLayer(
                kind, mixer, mixer_norm=to(norm(p + "mixer_norm", d)), mlp_norm=to(norm(p + "mlp_norm", d)), **mlp,
            )
            layers.append(_int4(layer) if int4_weights else layer)
            startup_progress.report(len(layers), c.n_layers)  # GET /health shows the fraction while loading
    final_norm = norm("norm", d).to(device=last_device, dtype=dtype)
    lm_head_cpu = None if c.tie_word_embeddings else get("lm_head")
    head: torch.Tensor | int4_layers.Float32Int4Weight | Q8Output
    if lm_head_cpu is None and table is not None and q8_output.can_read(table):
        head = Q8Output(table)  # the file's Q8_0 blocks, shared with the token lookup (int4 weights)
    elif lm_head_cpu is None and table is not None:  # tied to the kept blocks, with int4 weights (float_output above)
        head = int4_layers.Float32Int4Weight.from_table_groups(*table.int4_groups())
    elif lm_head_cpu is None:
        assert embed_cpu is not None
        head = embed_cpu
    elif tuple(lm_head_cpu.shape) != (c.vocab_size, d):
        raise ModelLoadError(f"{path}: weight 'lm_head' has shape {tuple(lm_head_cpu.shape)}")
    else:
        head = lm_head_cpu
    embed: torch.Tensor | QuantEmbedding
    if table is not None:
        embed = table
    else:
        assert embed_cpu is not None
        embed = embed_cpu.to(device=first_device, dtype=dtype).contiguous()
        if head is embed_cpu and last_device == first_device:
            head = embed  # tied: one float table
    if isinstance(head, torch.Tensor) and head is not embed:
        head = head.to(last_device, dtype).contiguous()
    model = HybridCausalLM(c, stages, embed=_placeholder(embed), layers=layers, norm=final_norm,
                           lm_head=_placeholder(head))
    if isinstance(embed, QuantEmbedding):
        int4.install(model, "embed", embed)
    if not isinstance(head, torch.Tensor):
        int4.install(model, "lm_head", head)
    if int4_weights:
        int4_layers.quantize_head(model)
    return model


def _placeholder(w: torch.Tensor | QuantEmbedding | int4.Int4Weight | Q8Output) -> torch.Tensor:
    # A module's buffer must be a tensor: a QuantEmbedding or 4-bit weight goes in after construction.
    return w if isinstance(w, torch.Tensor) else torch.empty(w.shape, device="meta", dtype=w.dtype)


def _int4(layer: torch.nn.Module) -> torch.nn.Module:
    """`layer` with its projections as 4-bit groups, on the CPU (`--cpu-weights int4`)."""
    int4_layers.quantize_layer(layer)
    return layer


def _hf_canonical(family: ModuleType, config: HybridConfig, name: str) -> str | None:
    for old, new in _PREFIXES:
        if name.startswith(old):
            name = new + name[len(old) :]
    if name.startswith("model.mtp."):  # a wrapper's next-token layer, as llama.cpp's converter reads it
        name = name[len("model.") :]
    if name.startswith("mtp.") and config.architecture in MTP_FAMILIES:
        return mtp.qwen_hf_key(name, config.n_layers, lambda rest: _mtp_layer_key(family, rest))
    if name.startswith(_SKIPPED_PREFIXES):
        return None
    if name in family.HF_GLOBAL_NAMES:
        return family.HF_GLOBAL_NAMES[name]
    if name.startswith("model.layers."):
        _, _, index, rest = name.split(".", 3)
        key = _layer_key(family, rest)
        if key is not None:
            return f"{index}.{key}"
    return None


def _layer_key(family: ModuleType, rest: str) -> str | None:
    # a family's own names, then its own rules, then the experts' names of the attention-only MoE families
    own_rule = family.hf_layer_key(rest) if hasattr(family, "hf_layer_key") else None
    return family.HF_LAYER_NAMES.get(rest) or own_rule or moe_loading.hf_layer_key(rest)


def _mtp_layer_key(family: ModuleType, rest: str) -> str | None:
    # the next-token layer's norm before attention under the name the block reads for every family
    key = _layer_key(family, rest)
    return "attn_norm" if key == "mixer_norm" else key


def _kept_mtp(config: HybridConfig, family: ModuleType, where: dict[str, tuple[str, str]], handles,
              folder: str) -> tuple[mtp.MtpLayer, ...]:
    """The folder's next-token layers (mtp.py), each tensor as stored except the norms, kept as the decoder's are
    loaded (with the family's NORM_OFFSET: Qwen's zero-centred RMSNorm weights become 1 + w)."""
    offset = float(getattr(family, "NORM_OFFSET", 0.0))
    keys = list(where)
    layers = []
    for found in mtp.layer_keys(config.n_layers, mtp.count_layers(config.n_layers, keys), keys):
        layer: mtp.MtpLayer = {}
        for key in found:
            file, name = where[key]
            try:
                tensor = handles[file].get_tensor(name)
            except Exception as e:
                raise ModelLoadError(f"{file}: cannot read tensor {name} ({e})") from None
            if key.endswith("norm") and offset:
                tensor = tensor.float() + offset
            layer[key.split(".", 1)[1]] = mtp.KeptTensor(name, str(tensor.dtype), tuple(tensor.shape), tensor)
        layers.append(layer)
    mtp.report_kept(tuple(layers), folder)
    return tuple(layers)


def load_hybrid_hf(folder: str, raw_config: dict, stages, dtype: torch.dtype,
                   cpu_experts: frozenset[int] = frozenset(), int4_weights: bool = False) -> LoadedModel:
    """Load a hybrid HF folder; same identity rules as `engine.model.hf_loading.load_hf` (config, file headers
    and every weight's bytes in the fingerprint)."""

    try:
        config = hybrid_config_from_hf(raw_config)
    except ConfigError as e:
        raise ModelLoadError(f"{os.path.join(folder, 'config.json')}: {e}") from None
    family = FAMILIES[config.architecture]
    files = safetensors_files(folder)
    h = header_fingerprint(config.describe(), files)
    tokenizer = folder_tokenizer(folder)
    handles, where = open_tensors(files, lambda name: _hf_canonical(family, config, name))
    content = xxhash.xxh3_128()

    def get(key: str) -> torch.Tensor | None:
        found = where.get(key)
        if found is None:
            return None
        file, name = found
        try:
            tensor = handles[file].get_tensor(name)
        except Exception as e:
            raise ModelLoadError(f"{file}: cannot read tensor {name} ({e})") from None
        content.update(key.encode())
        content.update(tensor.reshape(-1).view(torch.uint8).numpy())
        return tensor.float()

    if "lm_head" not in where and not config.tie_word_embeddings:
        raise ModelLoadError(f"{folder}: lm_head.weight is missing and config.json does not tie it to the embeddings")
    model = build_hybrid(config, stages, dtype, get, folder, cpu_experts, int4_weights)
    model.mtp = _kept_mtp(config, family, where, handles, folder)  # run by --spec mtp only
    h.update(content.digest())
    name = os.path.basename(os.path.normpath(folder))
    return LoadedModel(config, model, tokenizer, name, os.path.abspath(folder), h.hexdigest(), dtype)  # type: ignore[arg-type]
