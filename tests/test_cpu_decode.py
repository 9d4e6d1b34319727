"""The lean CPU decode step (engine/model/cpu_decode.py): bit for bit what forward_chunks computes for a step of
one-token rows, logits and K/V, in float32 and with 4-bit weights, alone and batched; the engine uses it on CPU;
what it does not cover it declines."""

from __future__ import annotations

import pytest
import torch

from engine.kv import KVBuffers, KVLayout
from engine.model import SeqChunk, int4, load_model, plan_stages
from engine.model.cpu_decode import CpuDecode, unsupported
from engine.model.graph_decode import configure
from engine.model.loader import read_model_config
from tests.model_fixtures import ARCHS, write_decode_models


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    return write_decode_models(tmp_path_factory.mktemp("tiny"))


def _load(path: str):
    return load_model(path, plan_stages(read_model_config(path).n_layers, "cpu", ""), torch.float32)


def _kv(lm, n_slots: int, ctx: int, dtype: torch.dtype = torch.float32) -> KVBuffers:
    c = lm.config
    return KVBuffers(KVLayout(c.n_layers, c.n_kv_heads, c.head_dim, dtype), n_slots, ctx, lm.model.stages)


def _same_steps(lm, kv_dtype: torch.dtype = torch.float32) -> None:
    """Three slots at different positions (one past a sliding window), three steps: the runner's logits and K/V
    equal forward_chunks' exactly, and so do those of one row decoded alone."""
    ctx = 64
    kv_ref, kv_new = _kv(lm, 4, ctx, kv_dtype), _kv(lm, 4, ctx, kv_dtype)
    gen = torch.Generator().manual_seed(1)
    prompts = {0: 20, 1: 3, 3: 40}  # slot -> prompt length
    for slot, n in prompts.items():
        ids = torch.randint(0, lm.config.vocab_size, (n,), generator=gen)
        for kv in (kv_ref, kv_new):
            lm.model.forward_chunks([SeqChunk(slot, 0, ids)], kv)
    runner = CpuDecode(lm.model)
    for step in range(3):
        chunks = [SeqChunk(slot, n + step, torch.tensor([7 + slot + step])) for slot, n in prompts.items()]
        expected = lm.model.forward_chunks(chunks, kv_ref)
        got = runner.run(chunks, kv_new)
        assert got is not None and torch.equal(got, expected), f"step {step}: logits differ"
    for slot, n in prompts.items():
        assert torch.equal(kv_new.read(slot, 0, n + 3), kv_ref.read(slot, 0, n + 3)), f"slot {slot}: K/V differ"
    assert kv_new.read(2, 0, ctx).abs().sum() == 0  # the slot no row uses is untouched
    alone = runner.run([SeqChunk(1, 6, torch.tensor([9]))], kv_new)
    assert alone is not None and torch.equal(alone, lm.model.forward_chunks([SeqChunk(1, 6, torch.tensor([9]))], kv_ref))


@pytest.mark.parametrize("arch", [*ARCHS, "qwen2-sliding"])
def test_lean_step_is_forward_chunks_bit_for_bit(tiny_models, arch):
    lm = _load(tiny_models[arch])
    assert unsupported(lm.model) is None
    assert (arch == "qwen2-sliding") == bool(lm.config.sliding_layers)  # a window of 8 that slot 3 passes
    with torch.inference_mode():
        _same_steps(lm)


@pytest.mark.skipif(not int4.available(), reason="this torch has no CPU int4 kernels")
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_lean_step_with_4_bit_weights_and_16_bit_kv(tiny_models, kv_dtype, kernel):
    lm = _load(tiny_models["llama"])
    int4.quantize_model(lm.model)
    assert isinstance(lm.model.layers[0].wqkv, int4.Int4Weight)
    with torch.inference_mode():
        _same_steps(lm, kv_dtype)


def test_engine_decodes_through_it_on_cpu_and_declines_the_rest(tiny_models):
    lm = _load(tiny_models["llama"])
    words = configure(lm.model, 2, cuda_graphs=True, deterministic=False)
    runner = lm.model.graphs
    assert isinstance(runner, CpuDecode) and "lean CPU step" in words
    kv = _kv(lm, 2, 32)
    lm.model.forward_chunks([SeqChunk(0, 0, torch.tensor([1, 2, 3]))], kv)  # prefill: forward_chunks' own
    lm.model.forward_chunks([SeqChunk(0, 3, torch.tensor([4])), SeqChunk(1, 0, torch.tensor([5, 6]))], kv)  # mixed
    assert runner.steps == 0
    lm.model.forward_chunks([SeqChunk(0, 4, torch.tensor([4]))], kv)
    assert runner.steps == 1
    with pytest.raises(AssertionError, match="one chunk per slot"):
        runner.run([SeqChunk(0, 5, torch.tensor([4])), SeqChunk(0, 7, torch.tensor([4]))], kv)

    gemma = _load(tiny_models["gemma3"])
    assert unsupported(gemma.model) == "Gemma layers"
    assert "through forward_chunks (Gemma layers)" in configure(gemma.model, 1, cuda_graphs=True, deterministic=False)
    assert gemma.model.graphs is None
