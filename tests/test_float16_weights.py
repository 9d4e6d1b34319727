"""--cpu-weights float16: projections and output matrix as FBGEMM-packed float16 (engine/model/float16.py)."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.model import float16
from engine.runtime.engine import Engine
from engine.runtime.requests import GenerationRequest, SamplingParams
from tests.model_fixtures import write_tiny_model
from tests.test_int4_weights import _choose_weights, bundled_decoder
from tools.conversation_cache_parity import run_scenario

pytestmark = pytest.mark.skipif(not float16.available(), reason="this torch has no FBGEMM fp16 linear")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("float16"), "llama")


def test_float16_weight_is_float32_math_on_float16_rounded_weights():
    """A row's result does not depend on how many rows share the call or on the thread count, and equals a
    float32 product with the weights rounded to float16 (to float32 rounding)."""
    torch.manual_seed(0)
    w = torch.randn(320, 192) * 0.05
    x = torch.randn(37, 192)
    packed = float16.Float16Weight(w)
    whole = packed(x)
    assert whole.dtype == torch.float32 and whole.shape == (37, 320)
    for n in (1, 2, 3, 8, 17, 36):
        assert torch.equal(packed(x[:n]), whole[:n]), f"rows change with {n} rows in the call"
    assert torch.equal(packed(x[20:21]), whole[20:21])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = packed(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, whole), "rows change with the thread count"
    ref = x @ w.half().float().t()
    assert torch.allclose(whole, ref, rtol=1e-5, atol=1e-5), (whole - ref).abs().max()
    assert packed.nbytes == 320 * 512 * 2 and packed.shape == (320, 192)  # `in` padded to a block of 512


def _greedy(engine: Engine, text: str, n: int = 16) -> list[int]:
    prompt = engine.tokenizer.encode(text)
    events = list(engine.submit(GenerationRequest("t", prompt, SamplingParams(temperature=0.0, max_tokens=n,
                                                                             ignore_eos=True))))
    return [e.token_id for e in events if e.token_id is not None]


def test_float16_engine_matches_float32_and_has_its_own_cache_identity(tiny_model):
    engines = {w: Engine.from_config(EngineConfig(model=tiny_model, cpu_weights=w, conversation_cache_min_free_mib=0))
               for w in ("float", "float16")}
    try:
        packed = engines["float16"]
        assert packed.weights_format == "float16"
        assert isinstance(packed.model.lm_head, float16.Float16Weight)
        assert isinstance(packed.model.layers[0].w_gate_up, float16.Float16Weight)
        text = "a harbour at dawn"
        assert _greedy(packed, text) == _greedy(packed, text) == _greedy(engines["float"], text)
        # a conversation parked with float32 weights is never restored into float16 K/V, nor the reverse
        assert engines["float"].cache_identity.key != packed.cache_identity.key
    finally:
        for e in engines.values():
            e.close()


def test_float16_is_refused_where_it_cannot_apply(tiny_model):
    with pytest.raises(ValueError, match="--cpu-weights float16: needs --dtype float32"):
        Engine.from_config(EngineConfig(model=tiny_model, cpu_weights="float16", dtype="bfloat16"))
    with pytest.raises(ValueError, match="expected one of"):
        EngineConfig(model=tiny_model, cpu_weights="fp16")


@pytest.mark.parametrize("storage", ["ram", "disk"])
def test_float16_conversation_restores_byte_identical(tiny_model, storage):
    base = {"model": tiny_model, "cpu_weights": "float16", "ctx_size": 2048, "conversation_cache_storage": storage,
            "conversation_cache_min_free_mib": 0}
    outcome = run_scenario("basic", base, n_words=60, max_tokens=12)
    assert outcome.passed, outcome.detail


def test_float16_decode_rows_are_batch_invariant_and_within_1e3_of_float32():
    """On the bundled model, a decoding slot's float16 logits are bitwise the same alone and batched with a
    prefill chunk and another decode, and within 0.3 % (relative L2) of float32's: only the weights' float16
    rounding differs (4-bit groups with bfloat16 activations are allowed 5 %)."""
    lm, decode = bundled_decoder()
    with torch.inference_mode():
        reference = decode(False)
        before, after = float16.pack_model(lm.model)
        # 576 columns pad to 1024 in FBGEMM's blocks; the tied output matrix stays as the float32 embedding too
        assert after < before, (before, after)
        assert isinstance(lm.model.layers[0].wqkv, float16.Float16Weight)
        alone, batched = decode(False), decode(True)
    for step, (a, b) in enumerate(zip(alone, batched, strict=True)):
        assert torch.equal(a, b), f"step {step}: float16 logits change when batched"
    for step, (a, ref) in enumerate(zip(alone, reference, strict=True)):
        relative = ((a - ref).norm() / ref.norm()).item()
        assert relative < 0.003, f"step {step}: float16 logits {relative:.4f} from float32"
        assert int(a.argmax()) == int(ref.argmax())


def test_auto_takes_float16_weights_where_the_4bit_kernel_is_the_scalar_fallback():
    out = _choose_weights("default", kernel_choice="aten")
    assert "auto -> float16" in out and "--cpu-weights auto: float16 (FBGEMM) weights, as" in out
