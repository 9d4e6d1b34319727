"""Hybrid models: recurrent layers with a fixed-size per-slot state plus a few attention layers.

Families: LFM2 (gated short convolutions), Qwen3.5 (gated DeltaNet + gated attention), Granite-4.0-H
(Mamba-2, a dense MLP and optionally routed experts), Nemotron-H (single Mamba-2 / attention / relu2 MLP / expert
blocks, `blocks`), Falcon-H1 (attention and Mamba-2 side by side). Each is loaded from an HF folder and matched against transformers in float32
(tests/test_hybrid_models.py).

Pieces: `config` (HybridConfig), `recurrent_state` (RecurrentStateBuffers, StateSnapshot: the per-slot
state beside the K/V buffers), `model` (HybridCausalLM.forward_chunks over K/V + state), `attention`,
the mixers of each family, and `loader` (the family registry; `engine.model.hf_loading` dispatches here when
config.json names a hybrid architecture).
"""

from engine.model.hybrid.config import HybridConfig, hf_hybrid_architecture
from engine.model.hybrid.model import HybridCausalLM
from engine.model.hybrid.recurrent_state import RecurrentStateBuffers, StateLayout, StateSnapshot

__all__ = [
    "HybridCausalLM",
    "HybridConfig",
    "RecurrentStateBuffers",
    "StateLayout",
    "StateSnapshot",
    "hf_hybrid_architecture",
]
