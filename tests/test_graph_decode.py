"""Decode modes: the flags, the buckets, the captured step's function against forward_chunks, one-GEMM batches.

The function a CUDA graph captures (`decode_step`) is plain PyTorch and runs on the CPU too, so its indexing,
padding and masks are checked here against the eager forward pass; the capture itself is checked on a GPU
(`-m gpu`): graph replay bit-identical to the same function run eagerly, and the same greedy tokens as the
eager forward pass.
"""

from __future__ import annotations

import pytest
import torch

from engine.cli import parse_config
from engine.config import EngineConfig
from engine.kv import KVBuffers, KVLayout
from engine.model import SeqChunk, load_model, plan_stages
from engine.model.graph_decode import (
    GraphDecode,
    batch_buckets,
    bucket,
    configure,
    length_buckets,
    unsupported,
)
from engine.model.projections import linear, logit_rows
from tests.model_fixtures import ARCHS, write_tiny_model

CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: write_tiny_model(root, arch) for arch in ARCHS}


def _load(path: str, device: str = "cpu", dtype: torch.dtype = torch.float32):
    from engine.model.loader import read_model_config

    return load_model(path, plan_stages(read_model_config(path).n_layers, device, ""), dtype)


def _kv(lm, n_slots: int, ctx: int) -> KVBuffers:
    c = lm.config
    return KVBuffers(KVLayout(c.n_layers, c.n_kv_heads, c.head_dim, lm.dtype), n_slots, ctx, lm.model.stages)


def test_flags_are_switches_and_round_trip():
    config = parse_config(["--no-cuda-graphs", "--deterministic", "--parallel", "2"])
    assert config.no_cuda_graphs and config.deterministic and config.parallel == 2
    assert not parse_config(["--deterministic", "false"]).deterministic
    assert parse_config(config.to_args()) == config
    defaults = EngineConfig()
    assert not defaults.no_cuda_graphs and not defaults.deterministic
    with pytest.raises(ValueError, match="--deterministic: expected true or false"):
        parse_config(["--deterministic", "maybe"])


def test_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert length_buckets(8192) == [256, 512, 1024, 2048, 4096, 8192]
    assert length_buckets(1000) == [256, 512, 1000]
    assert length_buckets(100) == [100]
    assert [bucket(n, [1, 2, 4, 6]) for n in (1, 2, 3, 5, 6)] == [1, 2, 4, 6, 6]
    with pytest.raises(ValueError, match="exceeds the largest bucket 6"):
        bucket(7, [1, 2, 4, 6])


def test_cpu_models_keep_their_kernels(tiny_models):
    lm = _load(tiny_models["llama"])
    words = configure(lm.model, 4, cuda_graphs=True, deterministic=False)
    assert lm.model.batch_invariant and not isinstance(lm.model.graphs, GraphDecode)  # the lean CPU step instead
    assert "CPU" in words
    assert unsupported(lm.model) == "not on a CUDA device"


def test_plan_declines_what_it_cannot_capture(tiny_models):
    lm = _load(tiny_models["llama"])
    kv = _kv(lm, 3, 300)
    runner = GraphDecode(lm.model, 2, capture=False)
    one = torch.tensor([5])
    assert runner.plan([SeqChunk(0, 10, one)], kv) == (1, 256)
    assert runner.plan([SeqChunk(0, 10, one), SeqChunk(2, 256, one)], kv) == (2, 300)
    assert runner.plan([SeqChunk(0, 10, torch.tensor([5, 6]))], kv) is None  # a prefill chunk
    assert runner.plan([SeqChunk(s, 10, one) for s in range(3)], kv) is None  # more rows than the largest bucket
    assert runner.plan([SeqChunk(0, 299, one)], kv) is None  # the pad rows' position


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_step_matches_forward_chunks(tiny_models, arch):
    """Three slots at different positions, padded to a bucket of 4: the same logits and K/V as the eager pass."""
    lm = _load(tiny_models[arch])
    ctx = 300
    kv_ref, kv_new = _kv(lm, 4, ctx), _kv(lm, 4, ctx)
    gen = torch.Generator().manual_seed(1)
    prompts = {0: 20, 1: 3, 3: 270}  # slot -> prompt length (slot 3 past the first length bucket)
    for slot, n in prompts.items():
        ids = torch.randint(0, lm.config.vocab_size, (n,), generator=gen)
        for kv in (kv_ref, kv_new):
            lm.model.forward_chunks([SeqChunk(slot, 0, ids)], kv)
    runner = GraphDecode(lm.model, 4, capture=False)
    for step in range(3):
        chunks = [SeqChunk(slot, n + step, torch.tensor([7 + slot + step])) for slot, n in prompts.items()]
        expected = lm.model.forward_chunks(chunks, kv_ref)
        got = runner.run(chunks, kv_new)
        assert got is not None and got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.argmax(-1), expected.argmax(-1))
    for slot, n in prompts.items():
        torch.testing.assert_close(kv_new.read(slot, 0, n + 3), kv_ref.read(slot, 0, n + 3), rtol=1e-5, atol=1e-5)
    assert kv_new.read(2, 0, ctx).abs().sum() == 0  # the slot no row uses is untouched


def test_forward_chunks_hands_one_token_steps_to_the_runner(tiny_models):
    lm = _load(tiny_models["llama"])
    kv = _kv(lm, 2, 64)
    lm.model.forward_chunks([SeqChunk(0, 0, torch.tensor([1, 2, 3]))], kv)
    lm.model.graphs = runner = GraphDecode(lm.model, 2, capture=False)
    try:
        lm.model.forward_chunks([SeqChunk(0, 3, torch.tensor([4]))], kv)
        lm.model.forward_chunks([SeqChunk(1, 0, torch.tensor([1, 2]))], kv)  # prefill: declined, computed eagerly
    finally:
        lm.model.graphs = None
    assert runner.replays == 1


def test_one_gemm_rows_match_per_row_products():
    """The fast path is one GEMM: the same products as the per-row kernels, up to bfloat16 rounding."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=gen).bfloat16()
    w = torch.randn(96, 64, generator=gen).bfloat16()
    per_row = linear(x, w, 5)
    one = linear(x, w, 5, fast=True)
    torch.testing.assert_close(one.float(), per_row.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(logit_rows(x, w, fast=True).float(), logit_rows(x, w).float(), rtol=2e-2, atol=2e-2)
    # Float32 weights on the CPU take oneDNN whatever `fast` says (batch-invariant, and the faster kernel there).
    xf, wf = x.float(), w.float()
    assert torch.equal(linear(xf, wf, 5, fast=True), linear(xf, wf, 5))


def assert_rows_as_alone(x: torch.Tensor, w: torch.Tensor) -> None:
    """`--deterministic`'s per-row products: each row of 1..len(x) one-token rows gets the bits it gets alone."""
    alone = [linear(x[j : j + 1], w, 1) for j in range(len(x))]
    for m in range(2, len(x) + 1):
        rows = linear(x[:m], w, m)
        assert all(torch.equal(rows[j], alone[j][0]) for j in range(m)), f"{m} rows"
        assert torch.equal(logit_rows(x[:m], w), rows)


def test_per_row_products_do_not_depend_on_the_row_count():
    gen = torch.Generator().manual_seed(0)
    assert_rows_as_alone(torch.randn(9, 256, generator=gen).bfloat16(), torch.randn(320, 256, generator=gen).bfloat16())


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("shape", [(4096, 4096), (4096, 14336), (6144, 4096)])  # 8B o, down, qkv
def test_per_row_products_do_not_depend_on_the_row_count_on_a_gpu(shape):
    """A batch of one is another cuBLAS kernel than a batch of two or more: an H100 gave the 8B o and down
    shapes other bits for one row until one row was padded to two."""
    gen = torch.Generator().manual_seed(0)
    n, k = shape
    x = torch.randn(16, k, generator=gen).bfloat16().cuda()
    assert_rows_as_alone(x, (torch.randn(n, k, generator=gen) * 0.02).bfloat16().cuda())


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("deterministic", [False, True])
def test_graph_replay_is_the_eager_step_bit_for_bit(tiny_models, deterministic):
    lm = _load(tiny_models["qwen3"], "cuda:0", torch.bfloat16)
    lm.model.batch_invariant = deterministic
    assert_graph_replays_the_eager_step(lm)


def assert_graph_replays_the_eager_step(lm) -> None:
    """12 captured decode steps of two slots (3 in the graph) give bit for bit the eager steps' logits and K/V."""
    ctx = 600
    kv_graph, kv_eager = _kv(lm, 3, ctx), _kv(lm, 3, ctx)
    gen = torch.Generator().manual_seed(2)
    prompts = {0: 30, 2: 300}
    for slot, n in prompts.items():
        ids = torch.randint(0, lm.config.vocab_size, (n,), generator=gen)
        for kv in (kv_graph, kv_eager):
            lm.model.forward_chunks([SeqChunk(slot, 0, ids)], kv)
    graphs, eager = GraphDecode(lm.model, 3), GraphDecode(lm.model, 3, capture=False)
    tokens = {slot: 5 for slot in prompts}
    for step in range(12):
        chunks = [SeqChunk(s, n + step, torch.tensor([tokens[s]])) for s, n in prompts.items()]
        a, b = graphs.run(chunks, kv_graph), eager.run(chunks, kv_eager)
        assert a is not None and b is not None and torch.equal(a, b)
        tokens = dict(zip(prompts, a.argmax(-1).tolist(), strict=True))
    assert graphs.captures >= 1 and graphs.replays == 12
    for slot, n in prompts.items():
        assert torch.equal(kv_graph.read(slot, 0, n + 12), kv_eager.read(slot, 0, n + 12))
