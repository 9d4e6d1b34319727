"""The native decode step on mixture-of-experts models (kernels/experts.c): within the native step's tolerance of
forward_chunks' PyTorch arithmetic on the same 4-bit experts for each routing (renormalised top-k, plain top-k
with a gated shared expert, Mixtral's, GraniteMoE's top-k-then-softmax, GLM-4.x MoE's grouped sigmoid routing
with an ungated shared expert and partial RoPE), a row the same alone and batched, and
OLMoE (full-width q/k norms) left to PyTorch with the reason said."""

from __future__ import annotations

import pytest
import torch

from engine.model import SeqChunk, int4, load_model, plan_stages
from engine.model.graph_decode import configure
from engine.model.loader import read_model_config
from engine.model.native_decode import NativeDecode, unsupported
from tests.int4_kernels import int4_kernel
from tests.moe_fixtures import write_tiny_moe_model
from tests.test_native_decode import PROMPTS, TOLERANCE, _kv, _relative, _step

NATIVE_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "granitemoe", "glm4_moe")


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny-moe")
    return {arch: write_tiny_moe_model(root, arch) for arch in (*NATIVE_ARCHS, "olmoe")}


def _load(path: str):
    with int4_kernel("blocks"):
        lm = load_model(path, plan_stages(read_model_config(path).n_layers, "cpu", ""), torch.float32)
        int4.quantize_model(lm.model)
    return lm


def _prefilled(lm):
    kv = _kv(lm)
    gen = torch.Generator().manual_seed(3)
    for slot, n in PROMPTS.items():
        lm.model.forward_chunks([SeqChunk(slot, 0, torch.randint(0, lm.config.vocab_size, (n,), generator=gen))], kv)
    return kv


@pytest.mark.parametrize("arch", NATIVE_ARCHS)
def test_native_experts_are_forward_chunks_within_tolerance(moe_models, arch):
    lm = _load(moe_models[arch])
    assert unsupported(lm.model) is None, unsupported(lm.model)
    layers = [layer for layer in lm.model.layers if layer.moe is not None]
    assert layers and all(isinstance(w, int4.Int4Weight) for w in layers[0].moe.gate_up)
    with torch.inference_mode():
        kv_ref, kv_new = _prefilled(lm), _prefilled(lm)
        runner = NativeDecode(lm.model)
        for k in range(4):
            expected = lm.model.forward_chunks(_step(k), kv_ref)
            got = runner.run(_step(k), kv_new)
            assert got is not None and got.shape == expected.shape
            assert _relative(got, expected) < TOLERANCE, f"step {k}: logits {_relative(got, expected):.2e} apart"
            assert torch.equal(got.argmax(1), expected.argmax(1))


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_a_row_is_the_same_alone_and_batched(moe_models, arch):
    """Batched rows pick different experts: each expert runs once over the rows that picked it, and a row's sum
    does not depend on which other rows shared its experts."""
    lm = _load(moe_models[arch])
    configure(lm.model, 4, cuda_graphs=True, deterministic=False)
    assert isinstance(lm.model.graphs, NativeDecode)
    with torch.inference_mode():
        kv_a, kv_b = _prefilled(lm), _prefilled(lm)
        batched = lm.model.forward_chunks(_step(0), kv_a)
        alone = torch.cat([lm.model.forward_chunks([ch], kv_b) for ch in _step(0)])
    assert torch.equal(batched, alone)
    for slot, n in PROMPTS.items():
        assert torch.equal(kv_a.read(slot, 0, n + 1), kv_b.read(slot, 0, n + 1)), f"slot {slot}: K/V differ"


def test_full_width_qk_norms_stay_on_pytorch(moe_models):
    lm = _load(moe_models["olmoe"])
    assert unsupported(lm.model) == "full-width q/k norms"
    assert "full-width q/k norms" in configure(lm.model, 2, cuda_graphs=True, deterministic=False)
    assert not isinstance(lm.model.graphs, NativeDecode)


def test_float_experts_stay_on_pytorch(moe_models):
    path = moe_models["qwen3_moe"]
    with int4_kernel("blocks"):
        lm = load_model(path, plan_stages(read_model_config(path).n_layers, "cpu", ""), torch.float32)
        int4.quantize_model(lm.model)
        for layer in lm.model.layers:  # the experts back in float, the rest 4-bit
            if layer.moe is not None:
                layer.moe.gate_up = torch.zeros(len(layer.moe.gate_up), *layer.moe.gate_up[0].shape)
    assert unsupported(lm.model) == "experts not in the native 4-bit blocks"
