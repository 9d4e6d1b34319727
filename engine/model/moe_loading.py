"""Loading mixture-of-experts weights: checkpoint names -> canonical keys, one layer's SparseMoe, Granite's scalars.

Canonical keys of a MoE layer i (what a loader's getter answers, as CPU tensors):
  "i.router"                    [n_experts, hidden]
  "i.experts.gate_up"           [n_experts, 2 * expert_size, hidden]   fused (transformers 5, GraniteMoE)
  "i.experts.gate", ".up"       [n_experts, expert_size, hidden]       stacked (GGUF ffn_gate_exps / ffn_up_exps)
  "i.experts.down"              [n_experts, hidden, expert_size]
  "i.expert.E.gate", ".up", ".down"                                    one expert at a time (HF checkpoints)
  "i.shared.gate", ".up", ".down", "i.shared_gate"                     Qwen2-MoE's shared expert and its gate
  "i.expert_bias"               [n_experts]                            what sigmoid routing adds to choose (LFM2-MoE,
                                                                       GLM-4.x MoE's e_score_correction_bias)
  "i.router_bias"               [n_experts]                            gpt-oss: added to the router's logits
  "i.experts.gate_up_bias"      [n_experts, 2 * expert_size]           gpt-oss's expert biases (HF: fused; GGUF:
  "i.experts.gate_bias", ".up_bias" [n_experts, expert_size]           gate and up apart)
  "i.experts.down_bias"         [n_experts, hidden]
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any, Protocol

import torch

from engine.errors import ModelLoadError
from engine.model import families, int4, kquant_weight
from engine.model.config import ModelConfig
from engine.model.kernels import RowsWeight
from engine.model.moe import Experts, SparseMoe
from engine.model.moe_config import MoeConfig, gpt_oss_experts

Getter = Callable[[str], "torch.Tensor | None"]
# The loader's getter (engine.model.build.Getter, not imported from there: build imports this module).
DeviceGetter = Callable[[str, torch.device, torch.dtype], "torch.Tensor | None"]
# A weight the file holds as 4-bit groups (a Q4_0 / Q4_1 / Q4_K tensor's own codes, scales and minimums; for
# "i.experts.gate" and the like the whole stack [n_experts, rows, cols]), or None when it holds it otherwise.
GroupsGetter = Callable[[str], "int4.Groups | None"]
# Tensors the file holds in one block type of the given ones (keys of engine/model/kquant_weight.py's CLASSES), as
# (that type, each one's bytes [..., rows, row bytes]); None, reading nothing, when it holds them otherwise or the
# native kernels cannot multiply them.
KQuantGetter = Callable[[list[str], tuple[str, ...]], "tuple[str, list[torch.Tensor]] | None"]

_HF_FIXED = {
    "mlp.gate.weight": "router",  # Qwen*, OLMoE
    "block_sparse_moe.gate.weight": "router",  # Mixtral
    "block_sparse_moe.router.layer.weight": "router",  # GraniteMoE
    "mlp.experts.gate_up_proj": "experts.gate_up",  # transformers 5's own parameter names
    "mlp.experts.down_proj": "experts.down",
    "block_sparse_moe.input_linear.weight": "experts.gate_up",  # GraniteMoE: [gate; up] per expert
    "block_sparse_moe.output_linear.weight": "experts.down",
    "mlp.shared_expert.gate_proj.weight": "shared.gate",  # Qwen2-MoE
    "mlp.shared_expert.up_proj.weight": "shared.up",
    "mlp.shared_expert.down_proj.weight": "shared.down",
    "mlp.shared_expert_gate.weight": "shared_gate",
    "mlp.shared_experts.gate_proj.weight": "shared.gate",  # GLM-4.x MoE: n_shared_experts as one, ungated
    "mlp.shared_experts.up_proj.weight": "shared.up",
    "mlp.shared_experts.down_proj.weight": "shared.down",
    "mlp.gate.e_score_correction_bias": "expert_bias",
    "mlp.router.weight": "router",  # gpt-oss (its experts' layout: gpt_oss_hf_layout)
    "mlp.router.bias": "router_bias",
    "mlp.experts.gate_up_proj_bias": "experts.gate_up_bias",
    "mlp.experts.down_proj_bias": "experts.down_bias",
    "mlp.experts.gate_up_proj_blocks": "experts.gate_up_blocks",  # a released checkpoint's MXFP4 (mxfp4.py)
    "mlp.experts.gate_up_proj_scales": "experts.gate_up_scales",
    "mlp.experts.down_proj_blocks": "experts.down_blocks",
    "mlp.experts.down_proj_scales": "experts.down_scales",
}
_HF_EXPERT = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight")
_HF_EXPERT_PART = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


class MoeShape(Protocol):
    """What building an expert block reads of a model's config (ModelConfig, or a hybrid model's HybridConfig)."""

    @property
    def moe(self) -> MoeConfig | None: ...

    @property
    def hidden_size(self) -> int: ...

    def is_moe_layer(self, index: int) -> bool: ...


def hf_layer_key(rest: str) -> str | None:
    """The canonical key (without the layer prefix) of an HF layer tensor name such as
    "mlp.experts.3.up_proj.weight", or None when it is not a MoE tensor."""
    key = _HF_FIXED.get(rest)
    if key is not None:
        return key
    m = _HF_EXPERT.fullmatch(rest)
    return f"expert.{m.group(1)}.{_HF_EXPERT_PART[m.group(2)]}" if m else None


def gpt_oss_hf_layout(key: str, t: torch.Tensor) -> torch.Tensor:
    """A gpt-oss checkpoint's expert tensor in the canonical layout: transformers keeps gate_up_proj as
    [n_experts, hidden, 2 * expert_size] with gate and up columns interleaved (gate even, up odd) and down_proj as
    [n_experts, expert_size, hidden] (x @ W); the canonical stacks are [n_experts, out, in] with gate rows, then up
    rows (llama.cpp's converter splits them the same way). Other tensors pass unchanged."""
    part = key.split(".", 1)[-1]
    if part == "experts.gate_up":
        t = t.transpose(1, 2)
        return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1)
    if part == "experts.gate_up_bias":
        return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1)
    if part == "experts.down":
        return t.transpose(1, 2)
    return t


def q_norm_shapes(config: ModelConfig, head_dim: int | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the q and k norm weights: one per head dim (Qwen3*; `head_dim`: a layer's own, Gemma 4's global
    ones), or the full q / k width (OLMoE)."""
    c = config
    if c.architecture == "olmoe":
        return (c.n_heads * c.head_dim,), (c.n_kv_heads * c.head_dim,)
    return (head_dim or c.head_dim,), (head_dim or c.head_dim,)


def fold_scales(config: ModelConfig, get: DeviceGetter) -> DeviceGetter:
    """A getter that folds GraniteMoE's multipliers into the weights, so the forward pass needs none of them:
    embeddings * embedding_multiplier, q rows * attention_multiplier * sqrt(head_dim) (SDPA then applies
    1/sqrt(head_dim)), attention output and expert down rows * residual_multiplier, output rows / logits_scaling
    (with tied embeddings, the unscaled embeddings / logits_scaling). Other models get `get` itself."""
    m = config.moe
    if m is None or (m.embedding_multiplier == m.residual_multiplier == m.logits_scaling == 1.0
                     and m.attention_multiplier is None):
        return get
    q_scale = 1.0 if m.attention_multiplier is None else m.attention_multiplier * math.sqrt(config.head_dim)

    def scaled(key: str, *where) -> torch.Tensor | None:  # `where`: the loader's device and dtype, passed on
        if key == "lm_head" and config.tie_word_embeddings:
            key = "embed_for_output"
        t = get("embed" if key == "embed_for_output" else key, *where)
        if t is None:
            return None
        part = key.rsplit(".", 1)[-1]
        if key == "embed":
            factor = m.embedding_multiplier
        elif key in ("lm_head", "embed_for_output"):
            factor = 1.0 / m.logits_scaling
        elif part in ("q", "q_bias"):
            factor = q_scale
        elif part in ("o", "down"):  # every tensor that writes into the residual stream from inside a layer
            factor = m.residual_multiplier
        else:
            return t
        return t if factor == 1.0 else t * factor

    return scaled


def output_is_separate(config: ModelConfig) -> bool:
    """Whether the output matrix must be built apart from the embeddings even when they are tied."""
    m = config.moe
    return m is not None and (m.embedding_multiplier != 1.0 or m.logits_scaling != 1.0)


def build_sparse_moe(
    config: MoeShape,
    index: int,
    get: Getter,
    need: Callable[[str, tuple[int, ...]], torch.Tensor],
    to: Callable[[torch.Tensor], torch.Tensor],
    path: str,
    *,
    to_experts: Callable[[torch.Tensor], torch.Tensor] | None = None,
    groups: GroupsGetter | None = None,
    kquant: KQuantGetter | None = None,
    dtype: torch.dtype = torch.float32,
) -> SparseMoe:
    """Layer `index`'s expert block from canonical keys (see the module docstring), on the device `to` moves to;
    the routed experts where `to_experts` moves them (`to` unless given; host RAM for experts placed there).
    With `groups` (given for experts that are to be 4-bit groups on the CPU, computing in `dtype`) the stacked
    experts come as one int4.Int4Weight per expert: from the file's own 4-bit groups where it has them, else
    quantised from the float stack (the groups quantize_experts would make). With `kquant` too, a stack the
    file holds as Q4_K, Q6_K or Q8_0 stays in its blocks instead (one weight per expert, no conversion)."""
    to_experts = to_experts or to
    c, m = config, config.moe
    assert m is not None and c.is_moe_layer(index), index
    p = f"{index}."
    e, inter, h = m.n_experts, m.expert_size, c.hidden_size
    down: Experts | None = None
    # A GGUF stack of gate and up rows fused (Gemma 4's ffn_gate_up_exps) stays in the file's blocks too.
    gate_up: Experts | None = None if kquant is None else _file_kquant([p + "experts.gate_up"], (e, 2 * inter, h), kquant)
    packable = groups is not None and int4.can_pack(2 * inter, h) and int4.can_pack(h, inter)
    if gate_up is not None:
        assert kquant is not None  # what found the fused stack
        down = _file_kquant([p + "experts.down"], (e, h, inter), kquant)
    elif packable:  # ... and one held as 4-bit groups (Q4_0, Q4_1) gives its own codes
        assert groups is not None  # packable
        gate_up = _fused_groups(p + "experts.gate_up", (e, 2 * inter, h), get, groups, dtype, path)
    if gate_up is None:
        gate_up = get(p + "experts.gate_up")
    if gate_up is None and kquant is not None:
        # The order of the reads (gate, up, down) is that of the float path: the fingerprint stays the same.
        gate_up = _file_kquant([p + "experts.gate", p + "experts.up"], (e, 2 * inter, h), kquant)
        down = _file_kquant([p + "experts.down"], (e, h, inter), kquant)
    if packable:
        assert groups is not None  # packable
        if gate_up is None:
            gate_up = _packed_experts([p + "experts.gate", p + "experts.up"], (e, inter, h), get, groups, dtype, path)
        if down is None and not isinstance(gate_up, torch.Tensor):
            down = _packed_experts([p + "experts.down"], (e, h, inter), get, groups, dtype, path)
    if gate_up is None:
        gate, up = get(p + "experts.gate"), get(p + "experts.up")
        if gate is not None and up is not None:
            _check(gate, (e, inter, h), p + "experts.gate", path)
            _check(up, (e, inter, h), p + "experts.up", path)
            gate_up = torch.cat((gate, up), dim=1)
        else:
            gate_up = torch.stack([torch.cat((need(f"{p}expert.{j}.gate", (inter, h)),
                                              need(f"{p}expert.{j}.up", (inter, h)))) for j in range(e)])
    if isinstance(gate_up, torch.Tensor):
        _check(gate_up, (e, 2 * inter, h), p + "experts.gate_up", path)
        gate_up = to_experts(gate_up)
    if down is None:
        down = get(p + "experts.down")
    if down is None:
        down = torch.stack([need(f"{p}expert.{j}.down", (h, inter)) for j in range(e)])
    if isinstance(down, torch.Tensor):
        _check(down, (e, h, inter), p + "experts.down", path)
        down = to_experts(down)
    shared: dict[str, torch.Tensor] = {}
    if m.shared_expert_size:
        s = m.shared_expert_size
        shared = {
            "shared_gate_up": to(torch.cat((need(p + "shared.gate", (s, h)), need(p + "shared.up", (s, h))))),
            "shared_down": to(need(p + "shared.down", (h, s))),
        }
        if m.shared_gated:  # Qwen2-MoE's sigmoid gate (GLM-4.x MoE adds its shared expert ungated)
            shared["shared_gate"] = to(_shared_gate(get(p + "shared_gate"), h, p, path))
    router = to(need(p + "router", (e, h)))
    if m.router_bias:  # gpt-oss
        shared["router_bias"] = to(need(p + "router_bias", (e,)))
    if m.expert_biases:
        gate_up_bias = get(p + "experts.gate_up_bias")
        if gate_up_bias is None:  # GGUF: gate and up apart
            gate_up_bias = torch.cat((need(p + "experts.gate_bias", (e, inter)), need(p + "experts.up_bias", (e, inter))),
                                     dim=1)
        _check(gate_up_bias, (e, 2 * inter), p + "experts.gate_up_bias", path)
        shared["gate_up_bias"] = to_experts(gate_up_bias)
        shared["down_bias"] = to_experts(need(p + "experts.down_bias", (e, h)))
    if m.routing == "sigmoid_bias":  # the bias that chooses experts stays float32, as the families keep it
        bias = get(p + "expert_bias")
        if bias is not None:
            _check(bias, (e,), p + "expert_bias", path)
            shared["expert_bias"] = bias.to(router.device, torch.float32)
    return SparseMoe(m, h, router=router, gate_up=gate_up, down=down, **shared)


def _file_kquant(keys: list[str], shape: tuple[int, int, int], kquant: KQuantGetter) -> list[RowsWeight] | None:
    """The expert stacks `keys` fused by rows (`shape` [n_experts, all rows, cols]) as the file's K-quant blocks,
    one weight per expert; None unless the file holds every one of them in the same K-quant (or Q8_0)."""
    found = kquant(keys, tuple(kquant_weight.CLASSES))
    return None if found is None else kquant_weight.expert_rows(found[0], found[1], shape)


def _fused_groups(key: str, shape: tuple[int, int, int], get: Getter, groups: GroupsGetter, dtype: torch.dtype,
                  path: str) -> list[int4.Int4Weight] | None:
    """A fused expert stack `key` as one Int4Weight per expert from the file's own 4-bit groups; None, reading
    nothing, when the file has no such stack in 4-bit groups."""
    found = groups(key)
    return None if found is None else _packed_experts([key], shape, get, lambda _: found, dtype, path)


def _packed_experts(keys: list[str], shape: tuple[int, int, int], get: Getter, groups: GroupsGetter,
                    dtype: torch.dtype, path: str) -> list[int4.Int4Weight]:
    """The expert stacks `keys` (each of `shape` [n_experts, rows, cols]) fused by rows, as one Int4Weight per
    expert: each stack's own 4-bit groups where the file has them (sliced per expert, no float copy), else its
    float values quantised. The slices are the rows of whole groups, so an expert's groups are the file's."""
    parts: list[int4.Groups] = []
    for key in keys:
        found = groups(key)
        if found is None:
            w = get(key)
            if w is None:
                raise ModelLoadError(f"{path}: weight {key!r} is missing")
            _check(w, shape, key, path)
            codes, scale, minimum = int4.quantize_groups(w.reshape(-1, shape[2]))
            found = codes.view(shape), scale.view(*shape[:2], -1), minimum.view(*shape[:2], -1)
        _check(found[0], shape, key, path)
        parts.append(found)
    codes, scale, minimum = (torch.cat(x, dim=1) if len(x) > 1 else x[0] for x in zip(*parts, strict=True))
    return [int4.Int4Weight.from_groups(codes[j], scale[j], minimum[j], dtype=dtype) for j in range(shape[0])]


def _shared_gate(t: torch.Tensor | None, h: int, p: str, path: str) -> torch.Tensor:
    if t is None:
        raise ModelLoadError(f"{path}: weight {p + 'shared_gate'!r} is missing")
    if tuple(t.shape) == (h,):  # GGUF keeps it 1-D
        t = t.view(1, h)
    _check(t, (1, h), p + "shared_gate", path)
    return t


def _check(t: torch.Tensor, shape: tuple[int, ...], key: str, path: str) -> None:
    if tuple(t.shape) != shape:
        raise ModelLoadError(f"{path}: weight {key!r} has shape {tuple(t.shape)}, expected {shape}")


def mlp_weights(config: ModelConfig, index: int) -> int:
    """Number of MLP weights of layer `index` (experts, router and shared expert for MoE layers)."""
    c, m = config, config.moe
    if not c.is_moe_layer(index):
        return 3 * c.hidden_size * c.intermediate_size
    assert m is not None  # is_moe_layer is false without a MoE config
    shared = 3 * c.hidden_size * m.shared_expert_size + c.hidden_size * m.shared_gated if m.shared_expert_size else 0
    return routed_expert_weights(c) + m.n_experts * c.hidden_size + shared


def routed_expert_weights(config: ModelConfig) -> int:
    """Number of routed-expert weights of one MoE layer, or of a layer's expert block beside its MLP (Gemma 4's):
    gate, up and down of every expert; 0 without experts."""
    m = config.moe
    if m is None:
        n_experts, _, expert_size = config.parallel_experts
        return n_experts * 3 * config.hidden_size * expert_size
    return m.n_experts * 3 * config.hidden_size * m.expert_size


# ---------------------------------------------------------------- GGUF (llama.cpp's names and metadata keys)

# llama.cpp architecture -> ours (families.py); Mixtral files say "llama" and carry llama.expert_count.
_GGUF_ARCHITECTURES = families.gguf_architectures("moe")
_GGUF_LAYER_KEYS = {
    "ffn_gate_inp.weight": "router",
    "ffn_gate_exps.weight": "experts.gate",
    "ffn_up_exps.weight": "experts.up",
    "ffn_down_exps.weight": "experts.down",
    "ffn_gate_shexp.weight": "shared.gate",
    "ffn_up_shexp.weight": "shared.up",
    "ffn_down_shexp.weight": "shared.down",
    "ffn_gate_inp_shexp.weight": "shared_gate",
    "exp_probs_b.bias": "expert_bias",
    "ffn_gate_inp.bias": "router_bias",  # gpt-oss
    "ffn_gate_exps.bias": "experts.gate_bias",
    "ffn_up_exps.bias": "experts.up_bias",
    "ffn_down_exps.bias": "experts.down_bias",
}
def gguf_layer_key(rest: str) -> str | None:
    """The canonical key (without the layer prefix) of a GGUF layer tensor such as "ffn_up_exps.weight"."""
    return _GGUF_LAYER_KEYS.get(rest)


def gguf_architecture(gguf_arch: str | None, meta: dict) -> str | None:
    """Our MoE architecture for a GGUF's general.architecture and metadata, or None for a dense file."""
    if gguf_arch == "llama" and meta.get("llama.expert_count"):
        return "mixtral"
    return _GGUF_ARCHITECTURES.get(gguf_arch or "")


def gguf_moe_config(arch: str, gguf_arch: str, meta: dict, tensor_names: set[str], n_layers: int,
                    path: str) -> MoeConfig:
    """Expert settings from `<gguf_arch>.expert_count`, `.expert_used_count`, `.expert_feed_forward_length`,
    `.expert_shared_feed_forward_length`, `.expert_weights_norm` and Granite's `.embedding_scale`,
    `.attention.scale`, `.residual_scale`, `.logit_scale`, and GLM's `.expert_gating_func` (2, sigmoid),
    `.expert_shared_count`, `.expert_weights_scale`, `.expert_group_count`, `.expert_group_used_count`. Where a key
    is absent, llama.cpp's own choice for the family holds (it renormalises Qwen3-MoE's and Mixtral's top-k weights,
    not Qwen2-MoE's or OLMoE's)."""

    def key(name: str, default=None):
        value = meta.get(f"{gguf_arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"{path}: metadata {gguf_arch}.{name} is missing")
        return value

    gating = meta.get(f"{gguf_arch}.expert_gating_func")
    sigmoid = arch in ("glm4_moe", "deepseek_v3")  # DeepSeek-V2's softmax deepseek2 files are not run
    if sigmoid:
        if gating != 2:  # llama.cpp: 1 softmax, 2 sigmoid
            raise ModelLoadError(f"{path}: expert_gating_func {gating}: expected 2 (sigmoid) for {gguf_arch}")
    elif gating not in (None, 1):
        raise ModelLoadError(f"{path}: expert gating function {gating} is not supported (expected 1, softmax)")
    if meta.get(f"{gguf_arch}.expert_shared_count", 0) and arch not in ("qwen2_moe", "glm4_moe", "deepseek_v3"):
        raise ModelLoadError(f"{path}: shared experts in {arch} are not supported (only Qwen2-MoE's and GLM's)")
    # Layers without a router tensor have a dense MLP (ffn_gate/ffn_up/ffn_down).
    dense = tuple(i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names)
    common: dict[str, Any] = {
        "n_experts": int(key("expert_count")),
        "top_k": int(key("expert_used_count")),
        "expert_size": int(meta.get(f"{gguf_arch}.expert_feed_forward_length") or key("feed_forward_length")),
        "dense_layers": dense,
    }
    norm = bool(meta.get(f"{gguf_arch}.expert_weights_norm", arch in ("qwen3_moe", "mixtral")))
    try:
        if sigmoid:  # what llama.cpp's converter writes of Glm4MoeConfig / DeepseekV3Config (moe_config._glm4_moe)
            n_shared = int(meta.get(f"{gguf_arch}.expert_shared_count", 0))
            moe = MoeConfig(**common, routing="sigmoid_bias",
                            norm_topk_prob=bool(meta.get(f"{gguf_arch}.expert_weights_norm", True)),
                            shared_expert_size=n_shared * common["expert_size"], shared_gated=False,
                            routed_scaling=float(meta.get(f"{gguf_arch}.expert_weights_scale", 1.0)), norm_eps=1e-20,
                            n_group=int(meta.get(f"{gguf_arch}.expert_group_count") or 1),
                            topk_group=int(meta.get(f"{gguf_arch}.expert_group_used_count") or 1))
        elif arch == "gpt_oss":  # llama.cpp builds in the clamped SwiGLU's limit and alpha (no metadata keys)
            moe = gpt_oss_experts(common, common.pop("expert_size"), 7.0, 1.702)
        elif arch == "granitemoe":
            moe = MoeConfig(**common, routing="topk_softmax", norm_topk_prob=False,
                            embedding_multiplier=float(key("embedding_scale", 1.0)),
                            attention_multiplier=float(key("attention.scale", 1.0)),
                            residual_multiplier=float(key("residual_scale", 1.0)),
                            logits_scaling=float(key("logit_scale", 1.0)))
        else:
            shared = int(key("expert_shared_feed_forward_length")) if arch == "qwen2_moe" else 0
            moe = MoeConfig(**common, routing="softmax_topk", norm_topk_prob=norm or arch == "mixtral",
                            shared_expert_size=shared)
        moe.check(n_layers)
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    return moe
