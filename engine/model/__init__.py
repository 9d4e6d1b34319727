"""Weights -> torch modules: the loader (GGUF, HF folders), the Llama-family forward, the tokenizer."""

from engine.model.build import LoadedModel
from engine.model.config import ModelConfig
from engine.model.llama import CausalLM, SeqChunk
from engine.model.loader import embedded_model_path, load_model, resolve_dtype
from engine.model.planning import plan_stages
from engine.model.tokenizer import StreamDecoder, Tokenizer

__all__ = [
    "CausalLM",
    "LoadedModel",
    "ModelConfig",
    "SeqChunk",
    "StreamDecoder",
    "Tokenizer",
    "embedded_model_path",
    "load_model",
    "plan_stages",
    "resolve_dtype",
]
