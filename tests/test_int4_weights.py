"""`--cpu-weights int4`: 4-bit projection weights on CPU stay close to float32 and keep the cache exact."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.model import SeqChunk, int4
from engine.runtime.engine import Engine
from engine.runtime.requests import GenerationRequest, SamplingParams
from tests.int4_kernels import KERNELS, dense, groups, implied, int4_kernel, same
from tests.model_fixtures import write_tiny_gguf, write_tiny_model
from tools.conversation_cache_parity import run_scenario

pytestmark = pytest.mark.skipif(not int4.available(), reason="this torch has no CPU int4 kernels")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("int4"), "llama")


def test_int4_weight_tracks_float_matmul(kernel):
    torch.manual_seed(0)
    # Weights on a Q4_1-style grid (per 32 values: min + scale * q, q in 0..15), as in a Q4_1 GGUF.
    q = torch.randint(0, 16, (64, 128)).float()
    low, scale = torch.randn(64, 4, 1), torch.rand(64, 4, 1) + 0.1
    w = (q.view(64, 4, 32) * scale + low).view(64, 128)
    x = torch.randn(3, 128)
    y = int4.Int4Weight(w)(x)
    assert y.dtype == torch.float32 and y.shape == (3, 64)
    ref = x @ w.t()
    # aten: bfloat16 activations, scales and zero points; blocks: int8 activations per block of 32, as llama.cpp's
    # Q8 activations: about 1 % relative error either way.
    relative = ((y - ref).norm() / ref.norm()).item()
    assert relative < 0.03, relative


def _greedy(engine: Engine, text: str, n: int = 16) -> list[int]:
    prompt = engine.tokenizer.encode(text)
    events = list(engine.submit(GenerationRequest("t", prompt, SamplingParams(temperature=0.0, max_tokens=n,
                                                                             ignore_eos=True))))
    return [e.token_id for e in events if e.token_id is not None]


def test_int4_engine_is_deterministic_and_refused_off_cpu(tiny_model):
    engine = Engine.from_config(EngineConfig(model=tiny_model, cpu_weights="int4", conversation_cache_mib=0))
    try:
        assert isinstance(engine.model.lm_head, int4.Int4Weight)
        assert _greedy(engine, "a harbour at dawn") == _greedy(engine, "a harbour at dawn")
    finally:
        engine.close()
    with pytest.raises(ValueError, match="--cpu-weights int4: needs --dtype float32"):
        Engine.from_config(EngineConfig(model=tiny_model, cpu_weights="int4", dtype="bfloat16"))


def test_int4_cache_identity_differs_from_float(tiny_model):
    engines = [Engine.from_config(EngineConfig(model=tiny_model, cpu_weights=w, conversation_cache_min_free_mib=0))
               for w in ("float", "int4")]
    try:
        keys = {e.cache_identity.key for e in engines}
        assert len(keys) == 2  # a conversation parked with float weights is never restored into int4 K/V
    finally:
        for e in engines:
            e.close()


def test_each_4bit_kernel_has_its_own_cache_identity():
    # The kernels round activations differently, so their K/V differ: a conversation parked by an engine on one
    # is recomputed, not restored, by an engine on the other. So does an output matrix read from the file's Q8_0
    # blocks (the bundled model's, where the native kernels load) against 4-bit groups.
    identities = {}
    for name in KERNELS:
        with int4_kernel(name):
            engine = Engine.from_config(EngineConfig(cpu_weights="int4", conversation_cache_min_free_mib=0))
            try:
                identities[name] = engine.cache_identity
            finally:
                engine.close()
    assert [identities[k].model["int4_kernel"] for k in KERNELS] == list(KERNELS)
    assert identities["blocks"].model["output"] == "Q8_0" and "output" not in identities["aten"].model
    assert identities["blocks"].key != identities["aten"].key


@pytest.mark.parametrize("storage", ["ram", "disk"])
def test_int4_conversation_restores_byte_identical(tiny_model, storage, kernel):
    base = {"model": tiny_model, "cpu_weights": "int4", "ctx_size": 2048, "conversation_cache_storage": storage,
            "conversation_cache_min_free_mib": 0}
    outcome = run_scenario("basic", base, n_words=60, max_tokens=12)
    assert outcome.passed, outcome.detail


# ---------------------------------------------------------------- 4-bit GGUF tensors keep their codes


def _load_q4(path: str, int4_weights: bool):
    from engine.model import load_model, plan_stages
    from engine.model.loader import read_model_config

    stages = plan_stages(read_model_config(path).n_layers, "cpu", "")
    return load_model(path, stages, torch.float32, int4_weights=int4_weights)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K"])
def test_q4_gguf_weights_become_int4_groups_without_a_float_round_trip(tmp_path, qtype, kernel):
    if qtype == "Q4_K" and kernel == "blocks":
        pytest.skip("with the native kernels Q4_K projections stay the file's rows (tests/test_kquant_weights.py)")
    import gguf
    import numpy as np

    from engine.model.gguf_dequant import q4_groups

    path = write_tiny_gguf(tmp_path, "llama", qtype=qtype, hidden_size=256, intermediate_size=512, head_dim=64)
    direct = _load_q4(path, int4_weights=True)
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.1.ffn_down.weight")
    assert t.tensor_type.name == qtype
    file_values = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type)))
    w = direct.model.layers[1].w_down
    assert isinstance(w, int4.Int4Weight)
    # The kernel's weights are the file's codes with the file's scales and minimums: rounded to bfloat16 by aten
    # (and its output is bfloat16), to float16 by blocks (Q4_0 and Q4_1 keep float16 ones: exact there).
    codes, scale, minimum = q4_groups(t.name, torch.from_numpy(np.array(t.data).reshape(-1)), t.tensor_type,
                                      file_values.shape)
    assert torch.equal(dense(w), implied(w, codes, scale, minimum))
    if kernel == "blocks" and qtype != "Q4_K":
        assert torch.equal(dense(w), file_values)
    # So it is at least as close to the file as re-quantising the dequantised floats.
    requantised = int4.Int4Weight(file_values)
    assert (dense(w) - file_values).abs().max() <= (dense(requantised) - file_values).abs().max()
    # And the model (every projection from the file's groups; the q/k rows un-permuted) gives the float
    # logits, at least as closely as quantising the float model (the former path) does.
    floats = _load_q4(path, int4_weights=False)
    assert all(isinstance(getattr(layer, n), int4.Int4Weight) for layer in direct.model.layers
               for n in ("wqkv", "wo", "w_gate_up", "w_down"))
    assert direct.fingerprint == floats.fingerprint  # the same file, read the same way
    ids = torch.tensor(direct.tokenizer.encode("The quick brown fox jumps over the lazy dog."))
    ref = floats.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(floats), all_logits=True)[0]
    ours = direct.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(direct), all_logits=True)[0]
    int4.quantize_model(floats.model)
    former = floats.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(floats), all_logits=True)[0]
    relative, former_relative = (((x - ref).norm() / ref.norm()).item() for x in (ours, former))
    # This random model amplifies the bfloat16 roundings: ~6 % for Q4_0 (re-quantising: ~50 %), ~3.5 % Q4_1.
    assert relative < 0.1 and relative <= former_relative + 1e-6, (relative, former_relative)


def test_q4_1_groups_spanning_0_to_15_pack_to_the_same_bytes_as_requantising(kernel):
    from gguf import GGMLQuantizationType

    from engine.model.gguf_dequant import dequantize, q4_groups
    from tests.model_fixtures import random_blocks

    raw = random_blocks(GGMLQuantizationType.Q4_1, 64, 256, seed=2, scale=0.01)
    raw.reshape(-1, 20)[:, 4] = 0xF0  # value 0 of each group has code 0, value 16 code 15
    raw = torch.from_numpy(raw.reshape(-1).copy())
    direct = int4.Int4Weight.from_groups(*q4_groups("w", raw, GGMLQuantizationType.Q4_1, (64, 256)))
    requantised = int4.Int4Weight(dequantize("w", raw, GGMLQuantizationType.Q4_1, (64, 256)))
    if kernel == "blocks":
        (codes, *scales), (requantised_codes, *requantised_scales) = groups(direct), groups(requantised)
    else:
        codes, requantised_codes = direct.packed, requantised.packed
        scales, requantised_scales = [direct.scales_zeros.float()], [requantised.scales_zeros.float()]
    assert torch.equal(codes, requantised_codes)
    for a, b in zip(scales, requantised_scales, strict=True):
        assert torch.allclose(a, b, rtol=1e-2)


def test_packing_in_row_slices_gives_the_kernel_bytes(monkeypatch):
    torch.manual_seed(1)
    w = torch.randn(320, 64)
    with int4_kernel("aten"):
        whole = int4.Int4Weight(w)
        monkeypatch.setattr(int4, "_ROWS", 128)  # slices of 128, 128 and 64 rows
        sliced = int4.Int4Weight(w)
    assert same(whole, sliced)
    codes, _, _ = int4.quantize_groups(w)
    assert torch.equal(whole.packed, torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1))


def _kv(lm):
    from engine.kv import KVBuffers, KVLayout

    c = lm.config
    return KVBuffers(KVLayout(c.n_layers, c.n_kv_heads, c.head_dim, lm.dtype), 1, 64, lm.model.stages)

def decode_rows(forward, prompt: torch.Tensor, other: torch.Tensor, batched: bool) -> list[torch.Tensor]:
    """Slot 0's logits: after `prompt`, then over 6 greedy decode steps, alone or (`batched`) in one call with a
    prefill chunk of slot 1 and a decode of slot 2 (which first prefilled `other`); `forward(chunks)` runs them."""
    rows = [forward([SeqChunk(0, 0, prompt)])[0]]
    forward([SeqChunk(2, 0, other)])
    pos = len(prompt)
    for step in range(6):
        token = torch.tensor([int(rows[-1].argmax())])
        chunks = [SeqChunk(0, pos, token)]
        if batched:
            chunks = [SeqChunk(1, 2 * step, other[:2]), *chunks, SeqChunk(2, len(other) + step, token)]
        logits = forward(chunks)
        rows.append(logits[next(i for i, ch in enumerate(chunks) if ch.slot == 0)])
        pos += 1
    return rows


def bundled_decoder():
    """The bundled model in float32 on the CPU, and `decode(batched)`: decode_rows over fresh K/V for 3 slots."""
    from engine.kv import KVBuffers, KVLayout
    from engine.model import embedded_model_path, load_model, plan_stages
    from engine.model.loader import read_model_config

    path = embedded_model_path()
    lm = load_model(path, plan_stages(read_model_config(path).n_layers, "cpu", ""), torch.float32)
    prompt = torch.tensor(lm.tokenizer.encode("A lighthouse keeper counts the ships that pass"))
    other = torch.tensor(lm.tokenizer.encode("Rain falls on the harbour wall"))

    def decode(batched: bool) -> list[torch.Tensor]:
        c = lm.config
        kv = KVBuffers(KVLayout(c.n_layers, c.n_kv_heads, c.head_dim, torch.float32), 3, 128, lm.model.stages)
        return decode_rows(lambda chunks: lm.model.forward_chunks(chunks, kv), prompt, other, batched)

    return lm, decode


def test_int4_decode_rows_are_batch_invariant_and_close_to_float32(kernel):
    """On the bundled Q4_1 model, a decoding slot's int4 logits are bitwise the same alone and batched with a
    prefill chunk and another decode; with the 4-bit projections (the Q4_1 codes themselves) and a float32
    output matrix they stay close to the float32 weights' logits (relative L2): within 5 % with PyTorch's kernel
    and its bfloat16 activations (0.2-2.7 % seen), within 0.5 % with the native one and its int16 activations
    (0.01-0.05 % seen). The int4 output matrix is the Q8_0 embedding re-quantised to 4 bits and moves them
    further (2-19 % seen)."""
    lm, decode = bundled_decoder()
    with torch.inference_mode():
        reference = decode(False)
        float_head = lm.model.lm_head
        int4.quantize_model(lm.model)
        assert isinstance(lm.model.layers[0].w_gate_up, int4.Int4Weight)
        alone, batched = decode(False), decode(True)
        # The output matrix is the Q8_0 embedding, re-quantised to 4 bits: most of the distance to float32.
        object.__setattr__(lm.model, "lm_head", float_head)
        float_head_rows = decode(False)
    for step, (a, b) in enumerate(zip(alone, batched, strict=True)):
        assert torch.equal(a, b), f"step {step}: int4 logits change when batched"
    for step, (f, ref) in enumerate(zip(float_head_rows, reference, strict=True)):
        relative = ((f - ref).norm() / ref.norm()).item()
        bound = 0.005 if kernel == "blocks" else 0.05
        assert relative < bound, f"step {step}: logits with int4 projections {relative:.4f} from float32"


def test_the_bundled_models_q8_0_output_matrix_is_read_from_the_file_blocks():
    """With the native kernels the tied output matrix is the embedding table's own Q8_0 blocks (no 4-bit copy):
    the bundled model's int4 logits are then within 0.5 % of float32's at every decode step (0.01-0.05 % seen,
    against 2-19 % with a 4-bit output matrix), rows batch-invariant, and the head a product, not a copy."""
    from engine.kv import KVBuffers, KVLayout
    from engine.model import embedded_model_path, load_model, plan_stages, q8_output
    from engine.model.loader import read_model_config

    lm, decode = bundled_decoder()
    with torch.inference_mode():
        reference = decode(False)
    path = embedded_model_path()
    with int4_kernel("blocks"):
        q = load_model(path, plan_stages(read_model_config(path).n_layers, "cpu", ""), torch.float32,
                       int4_weights=True)
    head = q.model.lm_head
    assert isinstance(head, q8_output.Q8Output) and head.blocks.data_ptr() == q.model.embed.blocks.data_ptr()
    prompt = torch.tensor(q.tokenizer.encode("A lighthouse keeper counts the ships that pass"))
    other = torch.tensor(q.tokenizer.encode("Rain falls on the harbour wall"))
    c = q.config

    def rows(batched: bool) -> list[torch.Tensor]:
        kv = KVBuffers(KVLayout(c.n_layers, c.n_kv_heads, c.head_dim, torch.float32), 3, 128, q.model.stages)
        return decode_rows(lambda chunks: q.model.forward_chunks(chunks, kv), prompt, other, batched)

    with torch.inference_mode():
        alone, batched = rows(False), rows(True)
    for step, (a, b, ref) in enumerate(zip(alone, batched, reference, strict=True)):
        assert torch.equal(a, b), f"step {step}: logits change when batched"
        relative = ((a - ref).norm() / ref.norm()).item()
        assert relative < 0.005, f"step {step}: int4 logits {relative:.4f} from float32"
        assert int(a.argmax()) == int(ref.argmax()), f"step {step}: another greedy token than float32"


_CHOOSE = """
import logging, sys, torch
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(message)s")
from engine.model import int4
from engine.runtime.startup import choose_weights_format
cpu = [(torch.device("cpu"), 0, 2)]
print("capability", torch.backends.cpu.get_cpu_capability())
print("auto ->", choose_weights_format("auto", torch.float32, cpu))
print("int4 ->", choose_weights_format("int4", torch.float32, cpu))
print("bf16 auto ->", choose_weights_format("auto", torch.bfloat16, cpu))
"""


def _choose_weights(capability: str | None, kernel_choice: str = "auto") -> str:
    """What choose_weights_format chooses in a fresh process with PyTorch's kernels at `capability` and
    STRATA_INT4_KERNEL=`kernel_choice`."""
    import os
    import subprocess
    import sys

    from engine.model import kernels

    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    env[kernels.ENV] = kernel_choice
    if capability:
        env["ATEN_CPU_CAPABILITY"] = capability
    done = subprocess.run([sys.executable, "-c", _CHOOSE], env=env, capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_auto_leaves_int4_weights_where_the_4bit_kernel_is_the_scalar_fallback():
    # ATEN_CPU_CAPABILITY=default runs PyTorch's scalar 4-bit kernel, as every MSVC build (PyTorch on Windows)
    # does: ~25x a float32 product's time, against ~0.7-1.4x where it is vectorised. Without the native kernel
    # (no C compiler, as on most Windows machines) that is the 4-bit kernel there is.
    out = _choose_weights("default", kernel_choice="aten")
    assert "capability DEFAULT" in out
    # float16 where FBGEMM is there (tests/test_float16_weights.py), else float32
    assert "auto -> float" in out and "--cpu-weights auto: float" in out
    assert "int4 -> int4" in out and "--cpu-weights int4: this PyTorch's 4-bit CPU kernel runs" in out
    assert "bf16 auto -> float" in out


def test_auto_takes_int4_weights_where_the_kernel_is_vectorised():
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("PyTorch has no vectorised 4-bit kernel for this CPU")
    out = _choose_weights("avx2", kernel_choice="aten")
    assert "capability AVX2" in out and "auto -> int4" in out and "4-bit CPU kernel: PyTorch's" in out
    assert "WARNING" not in out


def test_the_native_kernel_gives_int4_weights_whatever_pytorch_compiled():
    with int4_kernel("blocks"):
        pass  # skips where the native kernel cannot be built or run here
    # PyTorch's AVX2 kernel (most laptops; its scalar one, Windows', alike) and its AVX-512 one: the native kernel
    out = _choose_weights("avx2")
    assert "auto -> int4" in out and "4-bit CPU kernel: native" in out and "WARNING" not in out
    assert "4-bit CPU kernel: native" in _choose_weights(None)


def test_a_bad_kernel_choice_is_refused_by_name(monkeypatch):
    from engine.model import kernels

    monkeypatch.setenv(kernels.ENV, "fast")
    with pytest.raises(ValueError, match="STRATA_INT4_KERNEL='fast': expected one of auto, native, aten"):
        kernels.choice()
