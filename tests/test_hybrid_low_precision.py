"""`--kv-dtype` on hybrid models (tiny random LFM2, Qwen3.5, Granite-4.0-H): the attention layers' K/V follow the
K/V dtype while the recurrent state stays float32; a parked conversation continues exactly as the same mode's own
run without parking, and a mode's parked conversations belong to that mode only."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.runtime.engine import Engine
from tests.hybrid_fixtures import one_thread, write_tiny_hybrid  # noqa: F401 (fixture)
from tools.conversation_cache_parity import run_restart, run_scenario

ARCHS = ("lfm2", "qwen3_5", "granitemoehybrid")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hybrid-low-precision")
    return {arch: write_tiny_hybrid(root, arch) for arch in ARCHS}


def _base(folder: str, storage: str, **extra) -> dict:
    return {"model": folder, "devices": "cpu", "ctx_size": 512, "conversation_cache_storage": storage,
            "conversation_cache_min_free_mib": 0, "cpu_weights": "float", "prefill_chunk": 32,
            "conversation_cache_checkpoint_tokens": 64, **extra}


# ---------------------------------------------------------------- --kv-dtype


def test_a_hybrid_engine_keeps_attention_kv_in_the_chosen_dtype_and_its_state_in_float32(folders):
    keys, sizes = set(), {}
    for name in ("auto", "bfloat16", "float16"):
        engine = Engine.from_config(EngineConfig(**_base(folders["qwen3_5"], "ram", kv_dtype=name)))
        try:
            want = {"auto": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
            assert engine.kv.stages[0].k.dtype == want and engine.kv.layout.dtype == want
            assert engine.states is not None and engine.states.buffers.layout.dtype == torch.float32
            assert engine.cache_identity is not None
            keys.add(engine.cache_identity.key)  # another K/V dtype: another model's parked conversations
            sizes[name] = engine.stats_snapshot()["engine"].kv_bytes
        finally:
            engine.close()
    assert len(keys) == 3
    assert sizes["bfloat16"] * 2 == sizes["float16"] * 2 == sizes["auto"]


@pytest.mark.parametrize("storage", ["ram", "disk"])
@pytest.mark.parametrize("arch", ["lfm2", "qwen3_5", "granitemoehybrid"])
def test_a_parked_hybrid_conversation_with_16_bit_kv_continues_as_if_it_never_left(folders, arch, storage):
    """A, B, A with bfloat16 K/V: the restored K/V rows and recurrent state are byte-identical and the greedy
    output is the engine's own run that never parked A; from disk also after a restart."""
    base = _base(folders[arch], storage, kv_dtype="bfloat16")
    outcome = run_scenario("basic", base, n_words=40, max_tokens=8)
    assert outcome.passed, outcome.detail
    assert "recurrent state byte-identical" in outcome.detail
    if storage == "disk":
        outcome = run_restart(base, {}, n_words=40, max_tokens=8)
        assert outcome.passed, outcome.detail
