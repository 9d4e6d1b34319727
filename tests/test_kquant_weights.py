"""Q4_K rows multiplied as the file holds them (engine/model/kquant_weight.py, kernels/blocks.c q4k_matmul): the
product is the file's values times the activations within the int16 rounding, a row the same alone and batched;
a Q4_K mixture-of-experts GGUF keeps its expert stacks in the file's bytes (no conversion), closer to the file's
values than 4-bit groups, and decodes through the native step, beside Q6_K or Q8_0 down stacks kept likewise."""

from __future__ import annotations

import pytest
import torch

from engine.kv import KVBuffers, KVLayout
from engine.model import SeqChunk, gguf_dequant, load_model, moe_placement, plan_stages, q8_weight
from engine.model.int4 import Int4Weight
from engine.model.kquant_weight import CLASSES, Q4KWeight, Q6KWeight, q6k_to_q8_0
from engine.model.loader import read_model_config
from engine.model.native_decode import NativeDecode, unsupported
from engine.model.q8_weight import Q8Weight
from tests.int4_kernels import int4_kernel
from tests.model_fixtures import random_blocks, write_tiny_gguf
from tests.moe_fixtures import write_tiny_moe_gguf
from tests.test_moe_q4_experts import MOE_LAYERS, SIZES, file_rows
from tests.test_native_decode import TOLERANCE

gguf = pytest.importorskip("gguf")
Q4_K = gguf.GGMLQuantizationType.Q4_K


def _file_values(raw: torch.Tensor, rows: int, cols: int, kind: str = "Q4_K") -> torch.Tensor:
    return gguf_dequant.dequantize("w", raw.reshape(-1), gguf.GGMLQuantizationType[kind], (rows, cols))


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_products_are_the_files_values_and_rows_are_batch_invariant(kind):
    with int4_kernel("blocks"):
        torch.manual_seed(5)
        for rows, n, k in ((1, 16, 256), (5, 48, 512), (9, 33, 768), (3, 2, 1024)):
            raw = torch.from_numpy(random_blocks(gguf.GGMLQuantizationType[kind], n, k, seed=n, scale=0.01))
            w = CLASSES[kind](raw, (n, k))
            x = torch.randn(rows, k) * torch.logspace(-3, 1, k)  # a wide range of magnitudes in a group
            ref = x.double() @ _file_values(raw, n, k, kind).double().t()
            got = w(x)
            assert got.dtype == torch.float32 and got.shape == (rows, n)
            assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-4
            for r in range(rows):
                assert torch.equal(w(x[r : r + 1])[0], got[r]), f"row {r} of {rows} differs alone"


def test_mxfp4_products_are_the_files_values_and_rows_are_batch_invariant():
    mxfp4 = gguf.GGMLQuantizationType.MXFP4
    with int4_kernel("blocks"):
        for rows, n, k in ((1, 16, 64), (5, 48, 512), (9, 33, 96), (3, 2, 1024)):
            raw = torch.from_numpy(random_blocks(mxfp4, n, k, seed=n)).view(n, k // 32, 17)
            raw[..., 0] = torch.randint(110, 131, (n, k // 32), dtype=torch.uint8)  # e8m0: 2^-18 .. 2^2
            w = CLASSES["MXFP4"](raw.reshape(n, -1).contiguous(), (n, k))
            x = torch.randn(rows, k) * torch.logspace(-3, 1, k)
            ref = x.double() @ _file_values(raw, n, k, "MXFP4").double().t()
            got = w(x)
            assert got.dtype == torch.float32 and got.shape == (rows, n)
            assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-4
            for r in range(rows):
                assert torch.equal(w(x[r : r + 1])[0], got[r]), f"row {r} of {rows} differs alone"


def test_q6k_to_q8_0_rows_are_the_bytes_q8_0_rows_makes_of_the_files_values():
    with int4_kernel("blocks"):
        for seed, (n, k) in enumerate(((3, 256), (40, 1024), (7, 512))):
            # float16 d of every magnitude, subnormal and zero included (random_blocks without a scale)
            raw = torch.from_numpy(random_blocks(gguf.GGMLQuantizationType.Q6_K, n, k, seed=seed))
            assert torch.equal(q6k_to_q8_0(raw, (n, k)), q8_weight.q8_0_rows(_file_values(raw, n, k, "Q6_K")))


def test_the_rows_must_be_whole_blocks():
    with pytest.raises(AssertionError):
        Q4KWeight(torch.zeros(4, 144, dtype=torch.uint8), (4, 128))
    with pytest.raises(AssertionError):
        Q6KWeight(torch.zeros(4, 144, dtype=torch.uint8), (4, 256))


@pytest.fixture(scope="module")
def q4k_moe(tmp_path_factory) -> str:
    return write_tiny_moe_gguf(tmp_path_factory.mktemp("q4k"), "qwen3_moe",
                               expert_types=dict.fromkeys(("gate", "up", "down"), "Q4_K"), **SIZES)


@pytest.fixture(scope="module")
def mixed_moes(tmp_path_factory) -> dict[str, str]:
    """Q4_K gate and up stacks beside a Q6_K down stack (as llama.cpp's Q4_K_M mix has them in some layers) or a
    Q8_0 one."""
    return {down: write_tiny_moe_gguf(tmp_path_factory.mktemp(down), "qwen3_moe",
                                      expert_types={"gate": "Q4_K", "up": "Q4_K", "down": down}, **SIZES)
            for down in ("Q6_K", "Q8_0")}


def _load(path: str, kernel: str):
    with int4_kernel(kernel):
        return load_model(path, plan_stages(read_model_config(path).n_layers, "cpu", ""), torch.float32,
                          int4_weights=True)


def _logits(lm, kv=None) -> torch.Tensor:
    c = lm.config
    kv = kv or KVBuffers(KVLayout(c.n_layers, c.n_kv_heads, c.head_dim, lm.dtype), 1, 64, lm.model.stages)
    return lm.model.forward_chunks([SeqChunk(0, 0, torch.arange(3, 40))], kv, all_logits=True)[0]


def test_a_q4k_moe_keeps_the_files_expert_blocks_and_is_closer_to_its_values(q4k_moe):
    lm = _load(q4k_moe, "blocks")
    for i in MOE_LAYERS:
        moe = lm.model.layers[i].moe
        assert all(isinstance(w, Q4KWeight) for w in (*moe.gate_up, *moe.down))
        for j in (0, 5):
            assert torch.equal(moe.gate_up[j].blocks, file_rows(q4k_moe, i, ("gate", "up"), j))
            assert torch.equal(moe.down[j].blocks, file_rows(q4k_moe, i, ("down",), j))
    assert all(":q4k" in entry for entry in moe_placement.describe(lm.model.layers)["experts"])
    # The same model with its experts as the file's float values, and as 4-bit groups of the file's codes (the
    # native kernel's other format: each group's d x scale rounded to float16).
    kept = {i: (lm.model.layers[i].moe.gate_up, lm.model.layers[i].moe.down) for i in MOE_LAYERS}

    def swap(make) -> torch.Tensor:
        for i, stacks in kept.items():
            for name, stack in zip(("gate_up", "down"), stacks, strict=True):
                object.__setattr__(lm.model.layers[i].moe, name, make(stack))
        return _logits(lm)

    with int4_kernel("blocks"):
        ours = swap(lambda stack: stack)
        ref = swap(lambda stack: torch.stack([_file_values(w.blocks, *w.shape) for w in stack]))
        groups = swap(lambda stack: [Int4Weight.from_groups(*gguf_dequant.q4_groups("w", w.blocks.reshape(-1), Q4_K,
                                                                                    w.shape)) for w in stack])
    relative, groups_relative = ((x - ref).norm() / ref.norm() for x in (ours, groups))
    assert relative < 0.01 and relative <= groups_relative, (relative, groups_relative)


def _native_step_follows_forward_chunks(lm, prompts: dict[int, int]) -> None:
    """Three decode steps of the slots `prompts` (slot -> prompt length) through the native step stay within its
    tolerance of forward_chunks' on the same weights."""
    assert unsupported(lm.model) is None, unsupported(lm.model)
    c = lm.config
    with torch.inference_mode():
        kvs = [KVBuffers(KVLayout(c.n_layers, c.n_kv_heads, c.head_dim, torch.float32), len(prompts), 64,
                         lm.model.stages) for _ in range(2)]
        for kv in kvs:
            for slot, n in prompts.items():
                lm.model.forward_chunks([SeqChunk(slot, 0, torch.arange(2, 2 + n))], kv)
        runner = NativeDecode(lm.model)
        for k in range(3):
            step = [SeqChunk(slot, n + k, torch.tensor([9 + slot + k])) for slot, n in prompts.items()]
            expected = lm.model.forward_chunks(step, kvs[0])
            got = runner.run(step, kvs[1])
            assert got is not None
            assert ((got - expected).norm() / expected.norm()).item() < TOLERANCE


@pytest.mark.parametrize("mix", ["q4k", "q4k/q6k", "q4k/q8"])
def test_kquant_experts_decode_through_the_native_step(q4k_moe, mixed_moes, mix):
    path = q4k_moe if mix == "q4k" else mixed_moes["Q6_K" if mix == "q4k/q6k" else "Q8_0"]
    lm = _load(path, "blocks")
    moe = lm.model.layers[0].moe
    down = {"q4k": Q4KWeight, "q4k/q6k": Q6KWeight, "q4k/q8": Q8Weight}[mix]
    assert type(moe.gate_up[0]) is Q4KWeight and type(moe.down[0]) is down
    assert all(entry.endswith(mix) for entry in moe_placement.describe(lm.model.layers)["experts"])
    if mix != "q4k":
        assert torch.equal(moe.down[3].blocks, file_rows(path, 0, ("down",), 3))
    _native_step_follows_forward_chunks(lm, {0: 20, 1: 7})


PROJECTIONS = ("wqkv", "wo", "w_gate_up", "w_down")


@pytest.fixture(scope="module")
def q4k_dense(tmp_path_factory) -> str:
    """A dense Llama GGUF whose projections are all Q4_K (q/k rows permuted as llama.cpp's converter does)."""
    names = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    types = {f"blk.{i}.{name}.weight": "Q4_K" for i in range(3) for name in names}
    return write_tiny_gguf(tmp_path_factory.mktemp("dense"), "llama", tensor_types=types, hidden_size=256,
                           intermediate_size=256, head_dim=64)  # o's rows: 4 heads of 64, whole 256-value blocks


def _rows_values(w) -> torch.Tensor:
    return _file_values(w.blocks, *w.shape)


def test_dense_q4k_projections_are_the_files_rows_and_need_no_weights_cache(q4k_dense, tmp_path):
    lm = _load(q4k_dense, "blocks")
    floats = load_model(q4k_dense, plan_stages(read_model_config(q4k_dense).n_layers, "cpu", ""), torch.float32)
    for i in range(lm.config.n_layers):
        layer, exact = lm.model.layers[i], floats.model.layers[i]
        for name in PROJECTIONS:
            w = getattr(layer, name)
            assert type(w) is Q4KWeight, (i, name, type(w))
            # the file's values, q/k rows in the engine's order as the float path puts them
            assert torch.equal(_rows_values(w), getattr(exact, name)), (i, name)
    with int4_kernel("blocks"):
        cached = [load_model(q4k_dense, plan_stages(lm.config.n_layers, "cpu", ""), torch.float32, int4_weights=True,
                             weights_cache_dir=str(tmp_path)) for _ in range(2)]
    assert cached[0].fingerprint == cached[1].fingerprint == lm.fingerprint
    for name in PROJECTIONS:  # a second start takes them from the file again, not from the cache
        assert torch.equal(getattr(cached[1].model.layers[2], name).blocks, getattr(lm.model.layers[2], name).blocks)
    assert torch.equal(_logits(cached[1]), _logits(lm))


def test_dense_q4k_projections_decode_through_the_native_step(q4k_dense):
    _native_step_follows_forward_chunks(_load(q4k_dense, "blocks"), {0: 20})
