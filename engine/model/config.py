"""The shape of a Llama-family model, read from an HF config.json or from GGUF metadata."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from engine.model.moe_config import HF_MOE_ARCHITECTURES, MOE_ARCHITECTURES, MoeConfig, moe_from_hf

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", *MOE_ARCHITECTURES)

# HF `architectures[0]` / `model_type` -> our architecture name.
_HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    **HF_MOE_ARCHITECTURES,
}
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


class ConfigError(ValueError):
    """The model's configuration names something this engine does not run; the message says what."""


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

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(f"unknown architecture {self.architecture!r}; expected one of {', '.join(ARCHITECTURES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "n_layers", "n_heads", "n_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name}: expected a positive whole number, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
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

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer `index` runs a sparse expert block instead of the dense MLP."""
        return self.moe is not None and index not in self.moe.dense_layers

    def describe(self) -> dict:
        """JSON-able description; part of the identity of parked K/V."""
        out = asdict(self)
        if self.moe is None:
            del out["moe"]  # dense models keep the identity they had before expert support
        return out

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """From a parsed HF config.json (transformers 4.x `rope_scaling` or 5.x `rope_parameters`)."""
        archs = cfg.get("architectures") or []
        arch = next((_HF_ARCHITECTURES[a] for a in archs if a in _HF_ARCHITECTURES), None)
        if arch is None:
            model_type = cfg.get("model_type")
            if model_type in ARCHITECTURES and not archs:
                arch = model_type
            else:
                shown = ", ".join(archs) or f"model_type {model_type!r}"
                raise ConfigError(
                    f"unknown architecture {shown}; expected one of {', '.join(_HF_ARCHITECTURES)}"
                )
        try:
            hidden = int(cfg["hidden_size"])
            n_heads = int(cfg["num_attention_heads"])
            rope: dict[str, Any] = dict(cfg.get("rope_parameters") or {})
            rope.update(cfg.get("rope_scaling") or {})
            theta = float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0)))
            rope.pop("rope_theta", None)
            kind = rope.pop("type", None) or rope.get("rope_type") or "default"
            rope["rope_type"] = kind
            scaling = None if kind == "default" else rope
            moe = _moe(arch, cfg) if arch in MOE_ARCHITECTURES else None
            return cls(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                n_layers=int(cfg["num_hidden_layers"]),
                n_heads=n_heads,
                n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
                head_dim=int(cfg.get("head_dim") or hidden // n_heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=scaling,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("qkv_bias", True) if arch == "qwen2_moe"
                                    else cfg.get("attention_bias", arch == "qwen2")),
                qk_norm=arch in ("qwen3", "qwen3_moe", "olmoe"),
                moe=moe,
            )
        except KeyError as e:
            raise ConfigError(f"config.json lacks {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"config.json has a malformed value: {e}") from None


def _moe(arch: str, cfg: dict[str, Any]) -> MoeConfig:
    try:
        return moe_from_hf(arch, cfg)
    except ValueError as e:  # what the expert settings lack or hold that this engine cannot run
        raise ConfigError(f"config.json: {e}") from None
