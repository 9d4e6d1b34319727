"""The family registry: every architecture this engine runs, by the names an HF config.json and a GGUF file give
it, and the module that reads its settings and tensor names.

One table instead of a mapping per reader: config.py (dense and mixture-of-experts families from config.json),
gguf_loading.py and moe_loading.py (from GGUF metadata), hybrid/config.py and hybrid/gguf_loader.py (hybrid
families from config.json and GGUF) all look names up here. Adding a family is a row here plus its reader (docs/DETAILS.md, "Adding a model family").

A leaf module (it imports nothing of the engine), so every reader can import it without a circle.
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("dense", "moe", "hybrid")


@dataclass(frozen=True, slots=True)
class Family:
    """One architecture: our name for it and the names the formats give it."""

    name: str  # ModelConfig.architecture / HybridConfig.architecture
    kind: str  # dense: llama.py's layer; moe: the same with experts (moe.py); hybrid: engine/model/hybrid/
    reader: str  # the module that reads its config.json / GGUF metadata and tensor names
    hf_architectures: tuple[str, ...]  # config.json `architectures[0]`
    hf_model_types: tuple[str, ...] = ()  # config.json `model_type`, for a config without `architectures`
    gguf_architectures: tuple[str, ...] = ()  # GGUF `general.architecture` (empty: not read from GGUF)
    gguf_permuted_qk: bool = False  # llama.cpp's converter interleaves q/k rows (LlamaModel and its subclasses)

    def __post_init__(self) -> None:
        assert self.kind in KINDS, f"{self.name}: kind {self.kind!r}, expected one of {KINDS}"
        assert self.hf_architectures, f"{self.name}: no HF architecture name"


_DENSE = "engine.model.config"  # ModelConfig.from_hf; gguf_loading.gguf_config for GGUF
_GEMMA = "engine.model.gemma"  # what Gemma 3 adds to the dense reader
_GEMMA4 = "engine.model.gemma4"  # what Gemma 4 (text) adds to Gemma 3's
_MOE = "engine.model.moe_config"  # moe_from_hf; moe_loading for GGUF names and keys
_HYBRID = "engine.model.hybrid."  # + the family's module (hybrid/loader.py's FAMILIES)

FAMILIES: tuple[Family, ...] = (
    Family("llama", "dense", _DENSE, ("LlamaForCausalLM",), ("llama",), ("llama",), gguf_permuted_qk=True),
    Family("mistral", "dense", _DENSE, ("MistralForCausalLM",), ("mistral",), ("mistral",), gguf_permuted_qk=True),
    Family("qwen2", "dense", _DENSE, ("Qwen2ForCausalLM",), ("qwen2",), ("qwen2",)),
    Family("qwen3", "dense", _DENSE, ("Qwen3ForCausalLM",), ("qwen3",), ("qwen3",)),
    Family("gemma3", "dense", _GEMMA, ("Gemma3ForCausalLM",), ("gemma3", "gemma3_text"), ("gemma3",)),
    Family("gemma4", "dense", _GEMMA4, ("Gemma4ForCausalLM",), ("gemma4_text",), ("gemma4",)),
    Family("qwen3_moe", "moe", _MOE, ("Qwen3MoeForCausalLM",), ("qwen3_moe",), ("qwen3moe",)),
    Family("qwen2_moe", "moe", _MOE, ("Qwen2MoeForCausalLM",), ("qwen2_moe",), ("qwen2moe",)),
    Family("olmoe", "moe", _MOE, ("OlmoeForCausalLM",), ("olmoe",), ("olmoe",)),
    # Mixtral GGUF files say "llama" and carry llama.expert_count (moe_loading.gguf_architecture).
    Family("mixtral", "moe", _MOE, ("MixtralForCausalLM",), ("mixtral",), (), gguf_permuted_qk=True),
    Family("granitemoe", "moe", _MOE, ("GraniteMoeForCausalLM",), ("granitemoe",), ("granitemoe",),
           gguf_permuted_qk=True),
    Family("glm4_moe", "moe", _MOE, ("Glm4MoeForCausalLM",), ("glm4_moe",), ("glm4moe",)),
    # Multi-head latent attention (mla_config.py); llama.cpp's converter writes both as `deepseek2`, whose
    # computation is DeepSeek-V3's (GLM-4.7-Flash's file loads as that family).
    Family("deepseek_v3", "moe", _MOE, ("DeepseekV3ForCausalLM",), ("deepseek_v3",), ("deepseek2",)),
    Family("glm4_moe_lite", "moe", _MOE, ("Glm4MoeLiteForCausalLM",), ("glm4_moe_lite",)),
    Family("gpt_oss", "moe", _MOE, ("GptOssForCausalLM",), ("gpt_oss",), ("gpt-oss",)),
    Family("lfm2", "hybrid", _HYBRID + "lfm2", ("Lfm2ForCausalLM",), ("lfm2",), ("lfm2",)),
    Family("lfm2_moe", "hybrid", _HYBRID + "lfm2_moe", ("Lfm2MoeForCausalLM",), ("lfm2_moe",), ("lfm2moe",)),
    Family("qwen3_5", "hybrid", _HYBRID + "qwen3_5", ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),
           ("qwen3_5", "qwen3_5_text"), ("qwen35",)),
    Family("granitemoehybrid", "hybrid", _HYBRID + "granitemoehybrid", ("GraniteMoeHybridForCausalLM",),
           ("granitemoehybrid",), ("granitehybrid",)),
    Family("qwen3_next", "hybrid", _HYBRID + "qwen3_next", ("Qwen3NextForCausalLM",), ("qwen3_next",),
           ("qwen3next",)),
    Family("qwen3_5_moe", "hybrid", _HYBRID + "qwen3_5_moe",
           ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"), ("qwen3_5_moe", "qwen3_5_moe_text"),
           ("qwen35moe",)),
    Family("nemotron_h", "hybrid", _HYBRID + "nemotron_h", ("NemotronHForCausalLM",), ("nemotron_h",),
           ("nemotron_h", "nemotron_h_moe")),
    Family("falcon_h1", "hybrid", _HYBRID + "falcon_h1", ("FalconH1ForCausalLM",), ("falcon_h1",), ("falcon-h1",)),
)
BY_NAME = {f.name: f for f in FAMILIES}
assert len(BY_NAME) == len(FAMILIES), "one row per family"


def names(*kinds: str) -> tuple[str, ...]:
    """Our names of the families of these kinds, in table order."""
    return tuple(f.name for f in FAMILIES if f.kind in kinds)


def hf_architectures(*kinds: str) -> dict[str, str]:
    """HF `architectures[0]` -> our name, for the families of these kinds."""
    return {hf: f.name for f in FAMILIES if f.kind in kinds for hf in f.hf_architectures}


def hf_model_types(*kinds: str) -> dict[str, str]:
    """HF `model_type` -> our name, for the families of these kinds."""
    return {t: f.name for f in FAMILIES if f.kind in kinds for t in f.hf_model_types}


def gguf_architectures(*kinds: str) -> dict[str, str]:
    """GGUF `general.architecture` -> our name, for the families of these kinds."""
    return {g: f.name for f in FAMILIES if f.kind in kinds for g in f.gguf_architectures}

