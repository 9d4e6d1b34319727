"""The shape of a hybrid model (recurrent layers + a few attention layers), read from an HF config.json.

One frozen dataclass for every hybrid family: the fields a family does not use keep their neutral
defaults (0, 1.0), so `describe()` is one stable JSON-able identity per model (part of what a parked
conversation's state is checked against, like `ModelConfig.describe()` for K/V).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from engine.model import families
from engine.model.config import ROPE_TYPES, ConfigError
from engine.model.hybrid.nemotron_config import NemotronExperts
from engine.model.moe_config import MoeConfig

# Layer kinds. "attention" layers own K/V rows in the K/V buffers; "mlp" layers (Nemotron-H's feed-forward-only
# blocks) own nothing; "parallel" layers (Falcon-H1: attention and Mamba-2 side by side) own both K/V and a
# Mamba-2 state; the others own a fixed-size recurrent state.
ATTENTION, SHORT_CONV, DELTA, MAMBA, MLP = "attention", "short_conv", "gated_delta", "mamba2", "mlp"
PARALLEL = "parallel"
LAYER_KINDS = (ATTENTION, SHORT_CONV, DELTA, MAMBA, MLP, PARALLEL)
RECURRENT_KINDS = (SHORT_CONV, DELTA, MAMBA, PARALLEL)
KV_KINDS = (ATTENTION, PARALLEL)
MAMBA_KINDS = (MAMBA, PARALLEL)
MAMBA_NORMS = ("gated", "norm_then_gate", "gate_only")  # y*silu(z) normalised per group / normalised then gated / neither

# HF `architectures[0]` -> our architecture name (the `model_type` is accepted too); the registry is families.py.
HF_ARCHITECTURES = families.hf_architectures("hybrid")
_MODEL_TYPES = families.hf_model_types("hybrid")
ARCHITECTURES = families.names("hybrid")

def hf_hybrid_architecture(cfg: dict[str, Any]) -> str | None:
    """Our architecture name when a parsed config.json describes a hybrid model this package runs, else None."""
    for name in cfg.get("architectures") or []:
        if name in HF_ARCHITECTURES:
            return HF_ARCHITECTURES[name]
    return _MODEL_TYPES.get(str(cfg.get("model_type")))


@dataclass(frozen=True, slots=True)
class HybridConfig:
    """Everything the hybrid forward pass needs; `layer_kinds[i]` says what layer i mixes tokens with."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_kinds: tuple[str, ...]
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rotary_dim: int = 0  # leading dims of a head that RoPE rotates (0 = no RoPE, NoPE attention)
    attention_scale: float = 0.0  # softmax scale; 0 = head_dim ** -0.5
    attention_gate: bool = False  # Qwen3.5: q_proj also yields a per-channel sigmoid gate on the output
    qk_norm: bool = False
    conv_kernel: int = 0  # short convolution width of the recurrent layers (LFM2 L_cache, d_conv)
    conv_bias: bool = False
    # gated DeltaNet (Qwen3.5)
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    # Mamba-2 (Granite-4.0-H)
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_groups: int = 0
    mamba_state_dim: int = 0
    mamba_chunk: int = 256
    mamba_dt_min: float = 0.0
    mamba_dt_max: float = float("inf")
    mamba_norm: str = "gated"  # how the scan's output meets the gate z (MAMBA_NORMS; Falcon-H1 chooses)
    # Granite's scalar multipliers
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # Falcon-H1's muP multipliers by their config.json names, applied at load (falcon_h1.py)
    multipliers: dict | None = None
    # mixture-of-experts MLP (Qwen3-Next, Qwen3.5-MoE, Granite-4.0-H with experts): the layers not in moe.dense_layers run experts
    moe: MoeConfig | None = None
    nemotron_experts: NemotronExperts | None = None  # Nemotron-H's MoE blocks (engine/model/hybrid/nemotron_moe.py)

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(f"unknown hybrid architecture {self.architecture!r}; expected one of {', '.join(ARCHITECTURES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "n_heads", "n_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name}: expected a positive whole number, got {value!r}")
        if not self.layer_kinds:
            raise ConfigError("the model has no layers")
        bad = sorted({k for k in self.layer_kinds if k not in LAYER_KINDS})
        if bad:
            raise ConfigError(f"unknown layer kind(s) {bad}; expected {', '.join(LAYER_KINDS)}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ConfigError(f"rotary_dim must be even and at most head_dim ({self.head_dim}), got {self.rotary_dim}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", "default")
            if kind not in ROPE_TYPES:
                raise ConfigError(f"rope scaling {kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
        if any(k in RECURRENT_KINDS for k in self.layer_kinds) and self.conv_kernel < 1:
            raise ConfigError(f"conv_kernel: recurrent layers need a convolution width >= 1, got {self.conv_kernel}")
        if DELTA in self.layer_kinds:
            for name in ("linear_k_heads", "linear_v_heads", "linear_k_dim", "linear_v_dim"):
                if getattr(self, name) <= 0:
                    raise ConfigError(f"{name}: gated DeltaNet layers need a positive value")
            if self.linear_v_heads % self.linear_k_heads:
                raise ConfigError("linear_v_heads must be a multiple of linear_k_heads")
        if self.mamba_norm not in MAMBA_NORMS:
            raise ConfigError(f"mamba_norm {self.mamba_norm!r}: expected one of {', '.join(MAMBA_NORMS)}")
        if any(k in MAMBA_KINDS for k in self.layer_kinds):
            for name in ("mamba_heads", "mamba_head_dim", "mamba_groups", "mamba_state_dim", "mamba_chunk"):
                if getattr(self, name) <= 0:
                    raise ConfigError(f"{name}: Mamba-2 layers need a positive value")
            if self.mamba_heads % self.mamba_groups:
                raise ConfigError("mamba_heads must be a multiple of mamba_groups")
        if self.moe is not None:
            try:
                self.moe.check(self.n_layers)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if self.nemotron_experts is not None:
            try:
                self.nemotron_experts.check()
            except ValueError as e:
                raise ConfigError(str(e)) from None

    # ------------------------------------------------------------ derived shapes

    @property
    def n_layers(self) -> int:
        return len(self.layer_kinds)

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer `index` runs a sparse expert block instead of the dense MLP."""
        return self.moe is not None and index not in self.moe.dense_layers

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Model layer indices of the attention layers, in order (their K/V index is the position here)."""
        return tuple(i for i, k in enumerate(self.layer_kinds) if k in KV_KINDS)

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k in RECURRENT_KINDS)

    @property
    def softmax_scale(self) -> float:
        return self.attention_scale or self.head_dim**-0.5

    @property
    def conv_channels(self) -> int:
        """Channels of the short convolution of a recurrent layer (0 when the model has none)."""
        if SHORT_CONV in self.layer_kinds:
            return self.hidden_size
        if DELTA in self.layer_kinds:
            return 2 * self.linear_k_heads * self.linear_k_dim + self.linear_v_heads * self.linear_v_dim
        if any(k in MAMBA_KINDS for k in self.layer_kinds):
            return self.mamba_heads * self.mamba_head_dim + 2 * self.mamba_groups * self.mamba_state_dim
        return 0

    def rope_shape(self) -> RopeShape:
        """What `engine.model.rope.RotaryTable` reads, for the rotated part of a head."""
        return RopeShape(self.rotary_dim, self.rope_theta, self.rope_scaling, self.max_position_embeddings)

    def describe(self) -> dict:
        """JSON-able description; part of the identity of parked K/V and recurrent state."""
        out = asdict(self)
        out["layer_kinds"] = list(self.layer_kinds)
        if self.moe is None:
            del out["moe"]  # a dense model's identity keeps the form it had before experts existed
        else:
            out["moe"] = self.moe.describe()
        if self.multipliers is None:
            del out["multipliers"]
        if self.mamba_norm == "gated":
            del out["mamba_norm"]  # the identity of the models before Falcon-H1 keeps its form
        if self.nemotron_experts is None:
            del out["nemotron_experts"]
        else:
            out["nemotron_experts"]["layers"] = list(self.nemotron_experts.layers)
        return out


@dataclass(frozen=True, slots=True)
class RopeShape:
    """The fields of ModelConfig that RoPE reads (RotaryTable is duck-typed on them)."""

    head_dim: int
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
