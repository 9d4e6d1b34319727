"""The routed experts as grouped GEMMs (`engine.model.moe.grouped_mm_experts`, `torch._grouped_mm`) against the
per-expert loop, and decode steps of a mixture-of-experts model captured in CUDA graphs.

PyTorch runs `_grouped_mm` on the CPU too (through a loop of its own), so the sorting by expert, the offsets,
the way back to token order and each token's sum are checked here on the CPU against the loop, and so is the
grouped path forced through a whole model and through the function a decode graph captures. The engine
takes the grouped path only on a GPU with the CUDA kernel (`grouped_mm_usable`); there (`-m gpu`) the model's
grouped forward pass is checked against the loop, without a host synchronisation, and its decode steps replayed
from CUDA graphs against the same step run eagerly, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from engine.kv import KVBuffers, KVLayout
from engine.model import SeqChunk, load_model, plan_stages
from engine.model import moe as moe_module
from engine.model.graph_decode import GraphDecode, configure, unsupported
from engine.model.loader import read_model_config
from engine.model.moe import SparseMoe, _mlp, grouped_experts, grouped_mm_experts, grouped_mm_usable, route
from engine.model.moe_config import MoeConfig
from tests.moe_fixtures import write_tiny_moe_model
from tests.test_graph_decode import assert_graph_replays_the_eager_step

HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")
CUDA = torch.cuda.is_available()
GROUPED_GPU = CUDA and HAS_GROUPED_MM and torch.cuda.get_device_capability(0) in ((9, 0), (10, 0))


def _experts(n_experts: int, hidden: int, inter: int, dtype: torch.dtype, gen: torch.Generator):
    gate_up = torch.randn(n_experts, 2 * inter, hidden, generator=gen).div(hidden**0.5).to(dtype)
    down = torch.randn(n_experts, hidden, inter, generator=gen).div(inter**0.5).to(dtype)
    return gate_up, down


def _routing(tokens: int, n_experts: int, top_k: int, hidden: int, gen: torch.Generator):
    moe = MoeConfig(n_experts=n_experts, top_k=top_k, expert_size=8, routing="softmax_topk", norm_topk_prob=True)
    h = torch.randn(tokens, hidden, generator=gen)
    weights, experts = route(torch.randn(tokens, n_experts, generator=gen), moe)
    return h, weights, experts


def _loop(h, experts, weights, gate_up, down, n_single: int = 0, activation: str = "silu"):
    return grouped_experts(h, experts, weights, n_single, gate_up.shape[0],
                           lambda x, e, n_one: _mlp(x, gate_up[e], down[e], n_one, activation=activation))


@pytest.mark.skipif(not HAS_GROUPED_MM, reason="this torch has no torch._grouped_mm")
@pytest.mark.parametrize(("tokens", "n_experts", "top_k", "activation"),
                         [(1, 8, 2, "silu"), (37, 8, 2, "silu"), (3, 16, 4, "silu"), (64, 4, 4, "silu"),
                          (37, 8, 2, "gelu_tanh")])
def test_grouped_gemms_compute_what_the_per_expert_loop_computes(tokens, n_experts, top_k, activation):
    """Few tokens over many experts (experts with no rows), many tokens over few, every expert chosen; GeGLU
    experts (Gemma 4's) as well as SwiGLU ones."""
    gen = torch.Generator().manual_seed(tokens * 100 + n_experts)
    hidden, inter = 64, 32
    gate_up, down = _experts(n_experts, hidden, inter, torch.float32, gen)
    h, weights, experts = _routing(tokens, n_experts, top_k, hidden, gen)
    expected = _loop(h, experts, weights, gate_up, down, activation=activation)
    got = grouped_mm_experts(h, experts, weights, gate_up, down, activation)
    assert got.shape == h.shape and got.dtype == h.dtype
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not HAS_GROUPED_MM, reason="this torch has no torch._grouped_mm")
def test_a_tokens_terms_are_summed_in_expert_order_whatever_order_top_k_lists_them():
    """The same choices listed in another order give the same bits: the terms are put in ascending expert
    order (the loop's order of additions) before they are summed, here in bfloat16."""
    gen = torch.Generator().manual_seed(5)
    tokens, n_experts, top_k, hidden = 16, 8, 4, 64
    gate_up, down = _experts(n_experts, hidden, 32, torch.bfloat16, gen)
    h, weights, experts = _routing(tokens, n_experts, top_k, hidden, gen)
    h, weights = h.bfloat16(), weights.bfloat16()
    got = grouped_mm_experts(h, experts, weights, gate_up, down)
    shuffled = torch.randperm(top_k, generator=gen)
    assert not torch.equal(shuffled, torch.arange(top_k))
    assert torch.equal(grouped_mm_experts(h, experts[:, shuffled], weights[:, shuffled], gate_up, down), got)
    torch.testing.assert_close(got.float(), _loop(h, experts, weights, gate_up, down).float(), rtol=2e-2, atol=2e-2)


def test_the_engine_keeps_the_loop_on_the_cpu():
    gen = torch.Generator().manual_seed(0)
    assert not grouped_mm_usable(*_experts(4, 64, 32, torch.bfloat16, gen))


@pytest.mark.skipif(not HAS_GROUPED_MM, reason="this torch has no torch._grouped_mm")
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "glm4_moe"])
def test_the_grouped_path_through_the_model_and_the_captured_step_function(tmp_path, arch, monkeypatch):
    """The grouped path forced on the CPU, as a GPU model takes it by default: the model's logits within float32
    rounding of the per-expert loop's, and the function a CUDA graph captures (`decode_step`, run here without
    capture) gives forward_chunks' logits and K/V for a MoE model, with pad rows."""
    path = write_tiny_moe_model(tmp_path, arch)
    lm = load_model(path, plan_stages(read_model_config(path).n_layers, "cpu", ""), torch.float32)
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, lm.config.vocab_size, (40,), generator=gen)
    loop = lm.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(lm, 1, 64), all_logits=True)[0]
    calls = []

    def counted(*args):
        calls.append(args[0].shape[0])
        return grouped_mm_experts(*args)

    monkeypatch.setattr(moe_module, "grouped_mm_experts", counted)
    monkeypatch.setattr(SparseMoe, "grouped_ready", property(lambda self: True))
    lm.model.batch_invariant = False
    grouped = lm.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(lm, 1, 64), all_logits=True)[0]
    assert calls and calls[0] == len(ids)
    torch.testing.assert_close(grouped, loop, rtol=1e-4, atol=1e-4)
    kv_ref, kv_new = _kv(lm, 3, 300), _kv(lm, 3, 300)
    prompts = {0: 20, 1: 5, 2: 7}  # three rows: padded to the bucket of 4
    for slot, n in prompts.items():
        for kv in (kv_ref, kv_new):
            lm.model.forward_chunks([SeqChunk(slot, 0, ids[:n])], kv)
    runner = GraphDecode(lm.model, 4, capture=False)
    for step in range(3):
        chunks = [SeqChunk(slot, n + step, torch.tensor([7 + slot + step])) for slot, n in prompts.items()]
        expected = lm.model.forward_chunks(chunks, kv_ref)
        got = runner.run(chunks, kv_new)
        assert got is not None
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    for slot, n in prompts.items():
        torch.testing.assert_close(kv_new.read(slot, 0, n + 3), kv_ref.read(slot, 0, n + 3), rtol=1e-5, atol=1e-5)


def _kv(lm, n_slots: int, ctx: int) -> KVBuffers:
    c = lm.config
    return KVBuffers(KVLayout(c.n_layers, c.n_kv_heads, c.head_dim, lm.dtype), n_slots, ctx, lm.model.stages)


def _gpu_model(tmp_path, arch: str):
    path = write_tiny_moe_model(tmp_path, arch)
    return load_model(path, plan_stages(read_model_config(path).n_layers, "cuda:0", ""), torch.bfloat16)


needs_grouped_gpu = pytest.mark.skipif(not GROUPED_GPU, reason="needs an sm90 / sm100 GPU and torch._grouped_mm")


@pytest.mark.gpu
@needs_grouped_gpu
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "glm4_moe"])
def test_gpu_grouped_experts_match_the_loop_without_a_host_sync(tmp_path, arch):
    lm = _gpu_model(tmp_path, arch)
    layers = [layer for layer in lm.model.layers if layer.moe is not None]
    assert layers and all(layer.moe.grouped_ready for layer in layers)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, lm.config.vocab_size, (200,), generator=gen)
    with torch.inference_mode():
        lm.model.batch_invariant = True  # the per-expert loop
        loop = lm.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(lm, 1, 256), all_logits=True)[0].float()
        lm.model.batch_invariant = False  # grouped GEMMs
        fast = lm.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(lm, 1, 256), all_logits=True)[0].float()
        moe = layers[0].moe
        h = torch.randn(300, lm.config.hidden_size, device="cuda:0", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any read back to the host raises
        try:
            out = moe(h, 0, fast=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        ref = moe(h, 0, fast=False)
    error = (fast - loop).norm(dim=-1) / loop.norm(dim=-1)
    assert error.max().item() < 0.05 and (fast.argmax(-1) == loop.argmax(-1)).float().mean().item() >= 0.9
    assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2


@pytest.mark.gpu
@needs_grouped_gpu
@pytest.mark.parametrize("arch", ["qwen2_moe", "glm4_moe"])  # GLM: partial RoPE, grouped sigmoid routing
def test_gpu_moe_decode_is_captured_and_replays_the_eager_step_bit_for_bit(tmp_path, arch):
    lm = _gpu_model(tmp_path, arch)
    assert "CUDA graphs" in configure(lm.model, 3, cuda_graphs=True, deterministic=False)
    assert isinstance(lm.model.graphs, GraphDecode)
    lm.model.graphs = None
    assert_graph_replays_the_eager_step(lm)
    lm.model.batch_invariant = True
    assert unsupported(lm.model) == "mixture-of-experts layers with batch-invariant kernels (the per-expert loop)"
