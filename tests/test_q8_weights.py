"""8-bit projections (engine/model/q8_weight.py): with 4-bit CPU weights, the projections a GGUF holds with more than
4 bits a weight (Q5_0, Q6_K, Q8_0, ...) become Q8_0 rows near the file's values instead of 4-bit groups; they run
in the native decode step and are kept by the weights cache."""

from __future__ import annotations

import pytest
import torch

from engine.kv import KVBuffers, KVLayout
from engine.model import SeqChunk, load_model, plan_stages, q8_weight
from engine.model.int4 import Int4Weight
from engine.model.loader import read_model_config
from engine.model.native_decode import NativeDecode
from engine.model.q8_weight import Q8Weight
from tests.int4_kernels import int4_kernel
from tests.model_fixtures import write_tiny_gguf

# llama.cpp's Q4_K_M mix in small: 4-bit q/k/o, an 8-bit v, 5-bit gate/up, a 6-bit down (random K-quant blocks)
MIXED = {"blk.{}.attn_q.weight": "Q4_0", "blk.{}.attn_k.weight": "Q4_0", "blk.{}.attn_v.weight": "Q8_0",
         "blk.{}.attn_output.weight": "Q4_1", "blk.{}.ffn_gate.weight": "Q5_0", "blk.{}.ffn_up.weight": "Q5_0",
         "blk.{}.ffn_down.weight": "Q6_K"}


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory) -> str:
    types = {name.format(i): kind for i in range(3) for name, kind in MIXED.items()}
    # Q6_K takes rows of 256 values: a wider MLP than the tiny default
    return write_tiny_gguf(tmp_path_factory.mktemp("mixed"), "llama", tensor_types=types, intermediate_size=256)


def _load(path: str, *, int4_weights: bool = True, cache: str | None = None):
    stages = plan_stages(read_model_config(path).n_layers, "cpu", "")
    return load_model(path, stages, torch.float32, int4_weights=int4_weights, weights_cache_dir=cache)


def _decode(lm, steps: int = 6, runner=None) -> torch.Tensor:
    """Logits of a prompt's last token and of `steps` greedy steps after it, [steps + 1, vocab]."""
    c = lm.config
    kv = KVBuffers(KVLayout(c.n_layers, c.n_kv_heads, c.head_dim, torch.float32), 1, 64, lm.model.stages)
    step = runner.run if runner is not None else lm.model.forward_chunks
    with torch.inference_mode():
        out = [lm.model.forward_chunks([SeqChunk(0, 0, torch.arange(3, 15))], kv)]
        for i in range(steps):
            out.append(step([SeqChunk(0, 12 + i, out[-1][0].argmax().view(1))], kv))
    return torch.cat(out)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_q8_rows_hold_a_weight_within_int8_rounding_and_q8_0_values_exactly():
    torch.manual_seed(0)
    w = torch.randn(48, 96) * torch.logspace(-2, 1, 96)
    back = q8_weight.dequantize(q8_weight.q8_0_rows(w), (48, 96))
    step = w.view(48, 3, 32).abs().amax(-1, keepdim=True) / 127  # one code's width per block
    assert ((back - w).view(48, 3, 32).abs() <= step * 0.5 * (1 + 1e-3) + 1e-6).all()
    assert torch.equal(q8_weight.q8_0_rows(back), q8_weight.q8_0_rows(w))  # a Q8_0 matrix comes back as it was
    assert torch.equal(q8_weight.q8_0_rows(torch.zeros(16, 32)).view(16, 34)[:, 2:], torch.zeros(16, 32, dtype=torch.uint8))


def test_projections_the_file_holds_with_more_bits_become_8_bit(mixed_gguf):
    with int4_kernel("blocks"):
        lm = _load(mixed_gguf)
        kinds = {name: type(getattr(lm.model.layers[0], name)) for name in ("wqkv", "wo", "w_gate_up", "w_down")}
        # q/k are 4-bit in the file but share one product with the 8-bit v: the product is 8-bit
        assert kinds == {"wqkv": Q8Weight, "wo": Int4Weight, "w_gate_up": Q8Weight, "w_down": Q8Weight}
        floats = _load(mixed_gguf, int4_weights=False)
        for name in ("wqkv", "w_gate_up", "w_down"):
            eight, exact = getattr(lm.model.layers[1], name), getattr(floats.model.layers[1], name)
            # int8 steps are ~8x finer than a 5-bit grid's, but not on it: ~0.4-0.5 % RMS on random values
            assert _relative(q8_weight.dequantize(eight.blocks, eight.shape), exact) < 1e-2, name
        v_rows = slice(lm.config.n_heads * lm.config.head_dim + lm.config.n_kv_heads * lm.config.head_dim, None)
        wqkv = lm.model.layers[1].wqkv
        assert torch.equal(q8_weight.dequantize(wqkv.blocks, wqkv.shape)[v_rows], floats.model.layers[1].wqkv[v_rows])
        # the Q6_K down projection converted natively: the bytes q8_0_rows makes of the file's values
        assert torch.equal(lm.model.layers[1].w_down.blocks, q8_weight.q8_0_rows(floats.model.layers[1].w_down))
        # the decode follows the file's values more closely than 4-bit groups of them do
        reference = _decode(floats)
        eight_bit = _decode(lm)
    with int4_kernel("aten"):
        four_bit = _decode(_load(mixed_gguf))
    assert _relative(eight_bit, reference) < 0.5 * _relative(four_bit, reference)


def test_the_native_step_runs_8_bit_projections(mixed_gguf):
    with int4_kernel("blocks"):
        lm = _load(mixed_gguf)
        runner = NativeDecode(lm.model)
        assert _relative(_decode(lm, runner=runner), _decode(lm)) < 3e-3  # tests/test_native_decode.py's tolerance
        assert runner.steps == 6


def test_the_weights_cache_keeps_8_bit_projections(mixed_gguf, tmp_path):
    with int4_kernel("blocks"):
        first = _load(mixed_gguf, cache=str(tmp_path))
        again = _load(mixed_gguf, cache=str(tmp_path))
        assert again.fingerprint == first.fingerprint
        for name in ("wqkv", "wo", "w_gate_up", "w_down"):
            a, b = getattr(first.model.layers[2], name), getattr(again.model.layers[2], name)
            assert type(a) is type(b) and all(torch.equal(a.state()[k], b.state()[k]) for k in a.state())
        assert torch.equal(_decode(again), _decode(first))
