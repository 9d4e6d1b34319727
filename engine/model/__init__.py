"""Weights -> torch modules: the loader (GGUF, HF folders), the Llama-family forward, the tokenizer."""

from engine.model.config import ModelConfig
from engine.model.llama import CausalLM, SeqChunk
from engine.model.loader import LoadedModel, embedded_model_path, load_model, plan_stages, resolve_dtype
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
