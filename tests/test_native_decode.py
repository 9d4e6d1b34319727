"""The native decode step (engine/model/native_decode.py, kernels/step.c): within a stated tolerance of
forward_chunks' PyTorch arithmetic on the same 4-bit weights, and a row's logits and K/V bit for bit the same
alone, batched, beside a prefill, and on any thread count; the engine takes it where the weights are native."""

from __future__ import annotations

import pytest
import torch

from engine.kv import KVBuffers, KVLayout
from engine.model import SeqChunk, int4, load_model, plan_stages
from engine.model.graph_decode import configure
from engine.model.loader import read_model_config
from engine.model.native_decode import NativeDecode, unsupported
from tests.int4_kernels import int4_kernel
from tests.model_fixtures import ARCHS, write_decode_models

# Relative L2 distance allowed between the native step's logits and forward_chunks' on the same weights: the two
# round activations to int16 from inputs that differ in their last bits (other norm and exponential code), and
# those differences grow over the layers (and flip a 16-bit K/V rounding now and then); measured on these tiny
# models up to 8.4e-4 (bfloat16 K/V), and 0.13 % on the bundled model against float32 arithmetic, where PyTorch's
# path on the same weights was 0.10 %.
TOLERANCE = 3e-3
PROMPTS = {0: 20, 1: 3, 3: 40}  # slot -> prompt length; slot 3 passes the sliding window of 8


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    return write_decode_models(tmp_path_factory.mktemp("tiny"))


def _native_model(path: str):
    """The model with native 4-bit weights (skips where the native kernels cannot run)."""
    with int4_kernel("blocks"):
        lm = load_model(path, plan_stages(read_model_config(path).n_layers, "cpu", ""), torch.float32)
        int4.quantize_model(lm.model)
        assert unsupported(lm.model) is None, unsupported(lm.model)
    return lm


def _kv(lm, dtype: torch.dtype = torch.float32, n_slots: int = 4, ctx: int = 64) -> KVBuffers:
    c = lm.config
    return KVBuffers(KVLayout(c.n_layers, c.n_kv_heads, c.head_dim, dtype), n_slots, ctx, lm.model.stages)


def _prefilled(lm, dtype: torch.dtype) -> KVBuffers:
    kv = _kv(lm, dtype)
    gen = torch.Generator().manual_seed(1)
    for slot, n in PROMPTS.items():
        lm.model.forward_chunks([SeqChunk(slot, 0, torch.randint(0, lm.config.vocab_size, (n,), generator=gen))], kv)
    return kv


def _step(k: int) -> list[SeqChunk]:
    return [SeqChunk(slot, n + k, torch.tensor([7 + slot + k])) for slot, n in PROMPTS.items()]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("arch", [*ARCHS, "qwen2-sliding", "gemma3"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_step_is_forward_chunks_within_tolerance(tiny_models, arch, kv_dtype):
    lm = _native_model(tiny_models[arch])
    with torch.inference_mode():
        kv_ref, kv_new = _prefilled(lm, kv_dtype), _prefilled(lm, kv_dtype)
        runner = NativeDecode(lm.model)
        for k in range(4):
            expected = lm.model.forward_chunks(_step(k), kv_ref)
            got = runner.run(_step(k), kv_new)
            assert got is not None and got.shape == expected.shape and got.dtype == torch.float32
            assert _relative(got, expected) < TOLERANCE, f"step {k}: logits {_relative(got, expected):.2e} apart"
        for slot, n in PROMPTS.items():
            new, ref = kv_new.read(slot, 0, n + 4), kv_ref.read(slot, 0, n + 4)
            assert torch.equal(new[:, :, :n], ref[:, :, :n])  # the prompts' rows are forward_chunks' own
            assert _relative(new[:, :, n:], ref[:, :, n:]) < TOLERANCE, f"slot {slot}: decoded K/V too far apart"
        assert kv_new.read(2, 0, 64).abs().sum() == 0  # the slot no row uses is untouched
        assert runner.steps == 4


def test_a_row_is_the_same_alone_batched_beside_a_prefill_and_on_any_thread_count(tiny_models):
    lm = _native_model(tiny_models["qwen2-sliding"])
    configure(lm.model, 4, cuda_graphs=True, deterministic=False)
    assert isinstance(lm.model.graphs, NativeDecode)
    threads = torch.get_num_threads()
    with torch.inference_mode():
        kvs = [_prefilled(lm, torch.bfloat16) for _ in range(4)]
        batched = lm.model.forward_chunks(_step(0), kvs[0])
        alone = torch.cat([lm.model.forward_chunks([ch], kvs[1]) for ch in _step(0)])
        # slot 2 prefills beside the three decoding rows (a mixed step): they still go to the native step
        prompt = SeqChunk(2, 0, torch.arange(5, 17))
        mixed = lm.model.forward_chunks([*_step(0)[:2], prompt, _step(0)[2]], kvs[2])
        torch.set_num_threads(1 if threads > 1 else 2)
        try:
            other_threads = lm.model.forward_chunks(_step(0), kvs[3])
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(batched, alone) and torch.equal(batched, other_threads)
        assert torch.equal(mixed[[0, 1, 3]], batched)
        assert lm.model.graphs.steps == 1 + 3 + 1 + 1
        for slot, n in PROMPTS.items():
            rows = [kv.read(slot, 0, n + 1) for kv in kvs]
            assert all(torch.equal(rows[0], r) for r in rows[1:]), f"slot {slot}: K/V differ"
        # the prefill of the mixed step is what forward_chunks computes for it alone
        lm.model.graphs = None
        kv_alone = _kv(lm, torch.bfloat16)
        prompt_alone = lm.model.forward_chunks([prompt], kv_alone)
        assert torch.equal(mixed[2], prompt_alone[0])
        assert torch.equal(kvs[2].read(2, 0, 12), kv_alone.read(2, 0, 12))


def test_all_logits_of_one_token_rows_come_from_the_native_step(tiny_models):
    lm = _native_model(tiny_models["llama"])
    configure(lm.model, 4, cuda_graphs=True, deterministic=False)
    with torch.inference_mode():
        kv_a, kv_b = _prefilled(lm, torch.float32), _prefilled(lm, torch.float32)
        rows = lm.model.forward_chunks(_step(0), kv_a, all_logits=True)
        plain = lm.model.forward_chunks(_step(0), kv_b)
    assert isinstance(rows, list) and [tuple(r.shape) for r in rows] == [(1, lm.config.vocab_size)] * 3
    assert torch.equal(torch.cat(rows), plain)


def test_the_engine_takes_it_for_native_weights_only(tiny_models):
    lm = _native_model(tiny_models["qwen3"])
    assert "through the native step" in configure(lm.model, 2, cuda_graphs=True, deterministic=False)
    assert isinstance(lm.model.graphs, NativeDecode)

    path = tiny_models["llama"]
    float_weights = load_model(path, plan_stages(read_model_config(path).n_layers, "cpu", ""), torch.float32)
    words = configure(float_weights.model, 2, cuda_graphs=True, deterministic=False)
    assert "lean CPU step (projections not in the native 4-bit blocks)" in words
    assert not isinstance(float_weights.model.graphs, NativeDecode)
    with int4_kernel("aten"):
        int4.quantize_model(float_weights.model)
    assert unsupported(float_weights.model) == "projections not in the native 4-bit blocks"
