"""The shape of a Llama-family model, read from an HF config.json or from GGUF metadata."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from engine.model import families
from engine.model.gemma import HF_HEAD_DIM, HF_ROPE_THETA, hf_gemma_fields, hf_gemma_problem
from engine.model.gemma4 import hf_gemma4_fields, hf_gemma4_problem
from engine.model.mla_config import MlaConfig, mla_from_hf
from engine.model.moe_config import MOE_ARCHITECTURES, MoeConfig, moe_from_hf
from engine.model.sliding import check_windows, hf_sliding_layers

ARCHITECTURES = families.names("dense", "moe")

# HF `architectures[0]` / `model_type` (a config.json without `architectures`) -> our architecture name.
_HF_ARCHITECTURES = families.hf_architectures("dense", "moe")
_HF_MODEL_TYPES = families.hf_model_types("dense", "moe")
# Fields a dense Llama-family model leaves at these defaults; describe() omits them then, so the identity of
# such a model's parked K/V stays what it was before they existed.
_OPTIONAL_DEFAULTS = {"moe": None, "sliding_window": None, "sliding_layers": (), "rope_local_theta": None,
                      "query_pre_attn_scalar": None, "final_logit_softcapping": None, "rotary_dim": None,
                      "mtp_layers": 0, "per_layer_input": 0, "per_layer_vocab": 0, "attention_k_eq_v": False,
                      "rope_pairs": None, "global_head_dim": None, "global_kv_heads": None, "kv_shared_layers": 0,
                      "double_wide_mlp": False, "parallel_experts": (0, 0, 0), "mla": None}
# Multi-head latent attention families (engine/model/mla_config.py): heads share one compressed latent.
MLA_ARCHITECTURES = ("deepseek_v3", "glm4_moe_lite")
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
GPT_OSS_ROPE_THETA = 150000.0  # GptOssConfig's default_theta
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}


class ConfigError(ValueError):
    """The model's configuration names something this engine does not run; the message says what."""


def refuse_quantised(cfg: dict[str, Any], arch: str | None) -> None:
    """ConfigError for an HF config.json of a quantised checkpoint (every family's reader, hybrids' too): FP8 and
    the like keep their scales in tensors of their own, and read as floats without them the weights would be
    wrong (an FP8 code's value, not the weight), silently. gpt-oss's MXFP4 experts are read as such (mxfp4.py)."""
    quant = cfg.get("quantization_config")
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    if quant and not (arch == "gpt_oss" and method == "mxfp4"):
        raise ConfigError(f"quantization_config {method!r}: quantised checkpoints are not read (their scales "
                          "would be ignored); use a bfloat16 or float16 release of the model, or a GGUF")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Everything the forward pass needs to know about a model's shape."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    moe: MoeConfig | None = None  # mixture-of-experts families only (engine/model/moe_config.py)
    # Sliding-window attention (engine/model/sliding.py): the layers in `sliding_layers` see only the last
    # `sliding_window` positions.
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    rope_local_theta: float | None = None  # Gemma 3: the sliding layers' RoPE base (unscaled); None = rope_theta
    query_pre_attn_scalar: float | None = None  # Gemma 3: attention scale is its -1/2 power; None = head_dim
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap) when set
    # Partial RoPE (GLM-4.x MoE's partial_rotary_factor): only a head's leading `rotary_dim` channels rotate
    # (rotate-half within them); None = all head_dim channels.
    rotary_dim: int | None = None
    # GLM-4.x MoE, DeepSeek-V3, GLM-4.7-Flash: next-token (MTP) layers after the last decoder layer; their weights
    # are loaded and kept (CausalLM.mtp), run by `--spec mtp` only. Not a setting of the decoder, but what the
    # loaders read and keep.
    mtp_layers: int = 0
    # Multi-head latent attention (DeepSeek-V3, GLM-4.7-Flash): head_dim is then the RoPE'd width of a head
    # (transformers' own head_dim for them) and n_kv_heads 1, the one latent every head reads.
    mla: MlaConfig | None = None
    # Gemma 4 (engine/model/gemma4.py): per-layer input embeddings of this width (0: none) over a vocabulary of
    # `per_layer_vocab`; global layers whose values are their keys' projection; global layers rotating only their
    # first `rope_pairs` frequencies (proportional RoPE; None: all of them).
    per_layer_input: int = 0
    per_layer_vocab: int = 0
    attention_k_eq_v: bool = False
    rope_pairs: int | None = None
    # Gemma 4: the global (non-sliding) layers' head width and K/V head count where they differ from the sliding
    # layers' (`head_dim`, `n_kv_heads`); None: the same. The slots hold one K/V row shape (`kv_row`).
    global_head_dim: int | None = None
    global_kv_heads: int | None = None
    # Gemma 4: the last `kv_shared_layers` layers compute no K/V of their own; each reads the K/V of the last
    # earlier layer of its kind (sliding or global), so the slots and the cache hold only the layers before them
    # (`kv_layers`). With `double_wide_mlp` those layers' MLP is twice as wide.
    kv_shared_layers: int = 0
    double_wide_mlp: bool = False
    # Gemma 4's expert block beside every layer's dense MLP (gemma4_experts.py): (experts, top k, expert width);
    # (0, 0, 0): none.
    parallel_experts: tuple[int, int, int] = (0, 0, 0)

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(f"unknown architecture {self.architecture!r}; expected one of {', '.join(ARCHITECTURES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "n_layers", "n_heads", "n_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name}: expected a positive whole number, got {value!r}")
        if not (math.isfinite(self.rms_norm_eps) and self.rms_norm_eps > 0):
            raise ConfigError(f"rms_norm_eps: expected a small positive number, got {self.rms_norm_eps!r}")
        for name in ("rope_theta", "rope_local_theta"):
            theta = getattr(self, name, None)
            if theta is not None and not (math.isfinite(theta) and theta > 0):
                raise ConfigError(f"{name}: expected a positive number, got {theta!r}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rotary_dim is not None and (not isinstance(self.rotary_dim, int) or self.rotary_dim % 2
                                            or not 0 < self.rotary_dim < self.head_dim):
            raise ConfigError(f"rotary dimensions: expected an even number from 2 to below head_dim "
                              f"({self.head_dim}), got {self.rotary_dim!r} (partial_rotary_factor)")
        if self.per_layer_input < 0 or (self.per_layer_input > 0) != (self.per_layer_vocab > 0):
            raise ConfigError(f"per-layer inputs: expected a width and a vocabulary both > 0 or both 0, got "
                              f"{self.per_layer_input} and {self.per_layer_vocab}")
        for name in ("global_head_dim", "global_kv_heads"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ConfigError(f"{name}: expected a positive whole number, got {value!r}")
        global_kvh, global_dim = self.global_kv_heads or self.n_kv_heads, self.global_head_dim or self.head_dim
        if global_dim % 2 or self.n_heads % global_kvh:
            raise ConfigError(f"global layers: {self.n_heads} heads over {global_kvh} K/V heads of {global_dim} "
                              "(expected an even width and a divisor of the heads)")
        n_experts, top_k, expert_size = self.parallel_experts
        if any(self.parallel_experts) and not (0 < top_k <= n_experts and expert_size > 0):
            raise ConfigError(f"expert block: expected top_k_experts from 1 to num_experts ({n_experts}) and a "
                              f"moe_intermediate_size > 0, got {top_k} and {expert_size}")
        if not isinstance(self.kv_shared_layers, int) or not 0 <= self.kv_shared_layers < self.n_layers:
            raise ConfigError(f"num_kv_shared_layers: expected a whole number from 0 to {self.n_layers - 1}, got "
                              f"{self.kv_shared_layers!r}")
        kinds = {i in self.sliding_layers for i in range(self.n_layers)}
        if kinds != {i in self.sliding_layers for i in range(self.kv_layers)}:
            raise ConfigError(f"num_kv_shared_layers {self.kv_shared_layers}: the layers before the shared ones must "
                              "include a sliding and a global layer for them to read")
        if self.rope_pairs is not None and not 0 < self.rope_pairs < global_dim // 2:
            raise ConfigError(f"proportional RoPE: expected 1 to {global_dim // 2 - 1} rotated frequencies, "
                              f"got {self.rope_pairs} (partial_rotary_factor)")
        if not isinstance(self.mtp_layers, int) or self.mtp_layers < 0:
            raise ConfigError(f"num_nextn_predict_layers: expected a whole number >= 0, got {self.mtp_layers!r}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", "default")
            if kind not in ROPE_TYPES:
                raise ConfigError(f"rope scaling {kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
        if (self.moe is not None) != (self.architecture in MOE_ARCHITECTURES):
            raise ConfigError(f"{self.architecture}: expert settings are {'missing' if self.moe is None else 'unexpected'}")
        if self.moe is not None:
            try:
                self.moe.check(self.n_layers)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if (self.mla is not None) != (self.architecture in MLA_ARCHITECTURES):
            raise ConfigError(f"{self.architecture}: latent-attention settings are "
                              f"{'missing' if self.mla is None else 'unexpected'}")
        if self.mla is not None and (self.n_kv_heads != 1 or self.head_dim != self.mla.qk_rope_head_dim):
            raise ConfigError(f"latent attention: expected 1 K/V head of the RoPE width {self.mla.qk_rope_head_dim}, "
                              f"got {self.n_kv_heads} of {self.head_dim}")
        problem = check_windows(self.sliding_window, self.sliding_layers, self.n_layers)
        if problem:
            raise ConfigError(problem)

    @property
    def gemma(self) -> bool:
        """Gemma's layer: post-norms, GeGLU, embeddings scaled by sqrt(hidden) (Gemma 3 and 4)."""
        return self.architecture in ("gemma3", "gemma4")

    @property
    def norm_offset(self) -> bool:
        """Gemma 3's norms scale by (1 + w), stored as such by the loaders; Gemma 4's by w."""
        return self.architecture == "gemma3"

    @property
    def kv_layers(self) -> int:
        """The layers whose K/V the slots and the cache hold: all of them, less Gemma 4's K/V-sharing ones."""
        return self.n_layers - self.kv_shared_layers

    def kv_source(self, index: int) -> int:
        """The layer whose K/V layer `index` attends to: itself, or for a K/V-sharing layer the last layer of its
        kind before the shared ones (as transformers' kv_sharing_modes picks it)."""
        if index < self.kv_layers:
            return index
        sliding = index in self.sliding_layers
        return next(i for i in range(self.kv_layers - 1, -1, -1) if (i in self.sliding_layers) == sliding)

    def mlp_size(self, index: int) -> int:
        """Layer `index`'s MLP width: twice the model's on Gemma 4's K/V-sharing layers with double_wide_mlp."""
        return self.intermediate_size * (2 if self.double_wide_mlp and index >= self.kv_layers else 1)

    def layer_heads(self, index: int) -> tuple[int, int]:
        """(K/V heads, head width) of layer `index`: a global layer's own where the model gives them (Gemma 4)."""
        if index in self.sliding_layers:
            return self.n_kv_heads, self.head_dim
        return self.global_kv_heads or self.n_kv_heads, self.global_head_dim or self.head_dim

    @property
    def kv_row(self) -> tuple[int, int]:
        """(heads, width) of one token's K/V row of a layer in the slots and the cache: every layer's shape (for
        latent attention, MlaConfig.store_width), or
        with per-layer shapes (Gemma 4) the widest head width and enough heads of it for the widest layer (a
        narrower layer uses the row's first channels; the rest stays zero)."""
        if self.mla is not None:  # the latent of a latent-attention model split over the two rows
            return 1, self.mla.store_width
        shapes = {self.layer_heads(i) for i in range(self.n_layers)}
        if len(shapes) == 1:
            return shapes.pop()
        width = max(d for _, d in shapes)
        return max(-(-h * d // width) for h, d in shapes), width

    def layer_window(self, index: int) -> int | None:
        """The attention window of layer `index` (None = every earlier position)."""
        return self.sliding_window if index in self.sliding_layers else None

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer `index` runs a sparse expert block instead of the dense MLP."""
        return self.moe is not None and index not in self.moe.dense_layers

    def describe(self) -> dict:
        """JSON-able description; part of the identity of parked K/V."""
        out = asdict(self)
        for name, default in _OPTIONAL_DEFAULTS.items():
            if getattr(self, name) == default:
                del out[name]  # models without the feature keep the identity they had before it existed
        if "sliding_layers" in out:
            out["sliding_layers"] = list(self.sliding_layers)
        if self.moe is not None:
            out["moe"] = self.moe.describe()
        if self.mla is not None:
            out["mla"] = self.mla.describe()
        return out

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """From a parsed HF config.json (transformers 4.x `rope_scaling` or 5.x `rope_parameters`)."""
        if not isinstance(cfg, dict):
            raise ConfigError(f"config.json: expected a JSON object, got {type(cfg).__name__}")
        archs = cfg.get("architectures") or []
        arch = next((_HF_ARCHITECTURES[a] for a in archs if a in _HF_ARCHITECTURES), None)
        refuse_quantised(cfg, arch)
        if arch is None:
            model_type = cfg.get("model_type")
            if model_type in _HF_MODEL_TYPES and not archs:
                arch = _HF_MODEL_TYPES[model_type]
            else:
                shown = ", ".join(archs) or f"model_type {model_type!r}"
                raise ConfigError(
                    f"unknown architecture {shown}; expected one of {', '.join(_HF_ARCHITECTURES)}"
                )
        try:
            hidden = int(cfg["hidden_size"])
            n_heads = int(cfg["num_attention_heads"])
            n_layers = int(cfg["num_hidden_layers"])
            if min(hidden, n_heads, n_layers) <= 0:
                raise ConfigError(f"hidden_size {hidden}, num_attention_heads {n_heads}, num_hidden_layers "
                                  f"{n_layers}: expected positive whole numbers")
            rope_parameters = dict(cfg.get("rope_parameters") or {})
            params = rope_parameters
            if "full_attention" in params:  # per layer type (transformers 5's Gemma 3)
                params = dict(params["full_attention"] or {})
            if arch == "gpt_oss" and not params and not cfg.get("rope_scaling"):
                params = dict(GPT_OSS_ROPE)  # what GptOssConfig sets when config.json names none
            gemma = arch in ("gemma3", "gemma4")
            gemma_fields: dict[str, Any] = {}
            if gemma:  # their own readers: engine/model/gemma.py, gemma4.py
                problem = hf_gemma_problem(cfg) if arch == "gemma3" else hf_gemma4_problem(cfg)
                if problem:
                    raise ConfigError(problem)
                gemma_fields = hf_gemma_fields(cfg, rope_parameters) if arch == "gemma3" else hf_gemma4_fields(cfg)
            if arch == "gemma4":  # proportional RoPE is rope_pairs (gemma4.py), not a scaling of the base
                params = {"rope_theta": params.get("rope_theta", HF_ROPE_THETA)}
            theta, scaling = _rope(params, cfg, HF_ROPE_THETA if gemma else GPT_OSS_ROPE_THETA if arch == "gpt_oss"
                                   else 10000.0)
            moe = _moe(arch, cfg) if arch in MOE_ARCHITECTURES else None
            window, sliding = _windows(arch, cfg, n_layers)
            head_dim = int(cfg.get("head_dim") or (HF_HEAD_DIM if gemma else hidden // n_heads))
            mla = _mla(cfg, scaling) if arch in MLA_ARCHITECTURES else None
            if mla is not None:
                head_dim = mla.qk_rope_head_dim  # the RoPE tables' width; the heads' shapes are mla's
            glm = arch == "glm4_moe"
            if glm and scaling is not None:
                scaling.pop("partial_rotary_factor", None)  # rotary_dim says it
            return cls(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                n_layers=n_layers,
                n_heads=n_heads,
                n_kv_heads=1 if mla is not None else int(cfg.get("num_key_value_heads") or n_heads),
                head_dim=head_dim,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=scaling,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
                attention_bias=bool(cfg.get("qkv_bias", True) if arch == "qwen2_moe"
                                    else cfg.get("attention_bias", arch in ("qwen2", "gpt_oss"))),
                qk_norm=arch in ("qwen3", "qwen3_moe", "olmoe", "gemma3", "gemma4") or (glm and bool(cfg.get("use_qk_norm"))),
                moe=moe,
                sliding_window=window,
                sliding_layers=sliding,
                rope_local_theta=gemma_fields.get("rope_local_theta"),
                query_pre_attn_scalar=gemma_fields.get("query_pre_attn_scalar"),
                final_logit_softcapping=_optional_float(cfg.get("final_logit_softcapping")),
                rotary_dim=_rotary_dim(params, cfg, head_dim) if glm else None,
                mtp_layers=int(cfg.get("num_nextn_predict_layers", 0) or 0) if glm or mla is not None else 0,
                mla=mla,
                per_layer_input=gemma_fields.get("per_layer_input", 0),
                per_layer_vocab=gemma_fields.get("per_layer_vocab", 0),
                attention_k_eq_v=gemma_fields.get("attention_k_eq_v", False),
                rope_pairs=gemma_fields.get("rope_pairs"),
                global_head_dim=gemma_fields.get("global_head_dim"),
                global_kv_heads=gemma_fields.get("global_kv_heads"),
                kv_shared_layers=gemma_fields.get("kv_shared_layers", 0),
                double_wide_mlp=gemma_fields.get("double_wide_mlp", False),
                parallel_experts=gemma_fields.get("parallel_experts", (0, 0, 0)),
            )
        except KeyError as e:
            raise ConfigError(f"config.json lacks {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"config.json has a malformed value: {e}") from None


def _rope(params: dict[str, Any], cfg: dict[str, Any], default_theta: float) -> tuple[float, dict | None]:
    """(base, scaling or None) from `rope_parameters` (transformers 5) and/or `rope_theta`/`rope_scaling` (4.x)."""
    rope = dict(params)
    rope.update(cfg.get("rope_scaling") or {})
    theta = float(cfg.get("rope_theta", rope.get("rope_theta", default_theta)))
    rope.pop("rope_theta", None)
    kind = rope.pop("type", None) or rope.get("rope_type") or "default"
    rope["rope_type"] = kind
    return theta, None if kind == "default" else rope


def _rotary_dim(params: dict[str, Any], cfg: dict[str, Any], head_dim: int) -> int | None:
    """The rotated channels of a head from `partial_rotary_factor` (rope_parameters, or the top level as GLM's
    own config.json has it; 0.5 when absent, Glm4MoeConfig's default); None when it is the whole head."""
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5))
    if not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise ConfigError(f"partial_rotary_factor: expected a number in (0, 1], got {factor!r}")
    rotated = int(head_dim * factor)
    return None if rotated == head_dim else rotated


def _windows(arch: str, cfg: dict[str, Any], n_layers: int) -> tuple[int | None, tuple[int, ...]]:
    try:
        return hf_sliding_layers(arch, cfg, n_layers)
    except ValueError as e:  # a window declared where this engine does not run one, or malformed layer types
        raise ConfigError(f"config.json: {e}") from None


def _mla(cfg: dict[str, Any], scaling: dict | None) -> MlaConfig:
    try:
        return mla_from_hf(cfg, scaling)
    except ValueError as e:  # a latent-attention setting this engine does not run
        raise ConfigError(f"config.json: {e}") from None


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _moe(arch: str, cfg: dict[str, Any]) -> MoeConfig:
    try:
        return moe_from_hf(arch, cfg)
    except ValueError as e:  # what the expert settings lack or hold that this engine cannot run
        raise ConfigError(f"config.json: {e}") from None
