"""Mixture-of-experts families against transformers on the same tiny random weights (float32, CPU), through the
engine's own forward: whole prompts, chunked prefill then decode, two slots batched, routing ties, and a real
`strata serve` answering the openai SDK."""

from __future__ import annotations

import dataclasses

import openai
import pytest
import torch

from engine.config import EngineConfig
from engine.errors import ModelLoadError
from engine.kv import KVBuffers, KVLayout
from engine.model import SeqChunk, int4, load_model, plan_stages
from engine.model.loader import read_model_config
from engine.model.moe import SparseMoe
from engine.runtime.engine import Engine
from engine.runtime.requests import GenerationRequest, SamplingParams
from tests.engine_process import engine_process
from tests.model_fixtures import write_tiny_model
from tests.moe_fixtures import EXPERT_SIZE, MOE_ARCHS, N_EXPERTS, write_tiny_moe_gguf, write_tiny_moe_model
from tools.conversation_cache_parity import run_scenario

transformers = pytest.importorskip("transformers")
transformers.utils.logging.disable_progress_bar()

ATOL = 1e-4  # float32 on both sides; only summation orders differ
TEXT = "The quick brown fox jumps over the lazy dog. def add(a, b): return a + b  café 🙂 " * 2 + "Paris is"


def _load(path: str):
    return load_model(path, plan_stages(read_model_config(path).n_layers, "cpu", ""), torch.float32)


def _kv(lm, n_slots: int = 3, ctx: int = 256) -> KVBuffers:
    c = lm.config
    return KVBuffers(KVLayout(c.n_layers, c.n_kv_heads, c.head_dim, lm.dtype), n_slots, ctx, lm.model.stages)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.fixture(scope="session")
def moe_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("moe")
    return {arch: write_tiny_moe_model(root, arch) for arch in MOE_ARCHS}


@pytest.fixture(scope="session")
def reference(moe_models):
    """transformers' logits for TEXT, per family, computed once."""
    cache: dict[str, torch.Tensor] = {}

    def logits(arch: str, ids: torch.Tensor) -> torch.Tensor:
        if arch not in cache:
            model = transformers.AutoModelForCausalLM.from_pretrained(moe_models[arch], dtype=torch.float32).eval()
            with torch.no_grad():
                cache[arch] = model(ids[None]).logits[0]
        return cache[arch]

    return logits


@pytest.fixture(scope="session")
def loaded(moe_models):
    cache: dict = {}

    def get(arch: str):
        if arch not in cache:
            cache[arch] = _load(moe_models[arch])
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_logits_match_transformers(loaded, reference, arch):
    lm = loaded(arch)
    ids = torch.tensor(lm.tokenizer.encode(TEXT))
    assert len(ids) >= 90
    ref = reference(arch, ids)
    ours = lm.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(lm), all_logits=True)[0]
    diff = _max_diff(ours, ref)
    assert diff <= ATOL, f"{arch}: max abs logit diff {diff:.3g} > {ATOL} (logit scale {ref.abs().max():.3g})"
    n_moe = sum(isinstance(layer.moe, SparseMoe) for layer in lm.model.layers)
    assert n_moe == (2 if arch == "qwen3_moe" else 3)  # Qwen3-MoE's layer 1 is dense (mlp_only_layers)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_chunked_prefill_and_decode_equal_one_shot(loaded, reference, arch):
    lm = loaded(arch)
    ids = torch.tensor(lm.tokenizer.encode(TEXT))
    ref = reference(arch, ids)
    kv, n = _kv(lm), len(ids)
    cuts = [0, 7, 40, n - 4]
    for a, b in zip(cuts, cuts[1:], strict=False):
        got = lm.model.forward_chunks([SeqChunk(2, a, ids[a:b])], kv, all_logits=True)[0]
        diff = _max_diff(got, ref[a:b])
        assert diff <= ATOL, f"{arch}: prefill chunk [{a},{b}) differs from transformers by {diff:.3g}"
    for pos in range(n - 4, n):
        got = lm.model.forward_chunks([SeqChunk(2, pos, ids[pos : pos + 1])], kv)[0]
        diff = _max_diff(got, ref[pos])
        assert diff <= ATOL, f"{arch}: decode at position {pos} differs from transformers by {diff:.3g}"


@pytest.mark.parametrize("backend", ["onednn", "blas"])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_two_slots_batched_equal_alone(loaded, arch, backend, monkeypatch):
    """A slot's logits are bitwise the same whether another slot's prefill and decodes share its forward calls
    (so its tokens share experts' matmuls with the other slot's tokens), through oneDNN and through the BLAS
    path (gemv rows for one-token chunks, what runs on CUDA)."""
    import engine.model.projections as projections

    if backend == "blas":
        monkeypatch.setattr(projections, "_ONEDNN", False)
    elif not projections._ONEDNN:
        pytest.skip("this torch build has no oneDNN")
    lm = loaded(arch)
    mine = torch.tensor(lm.tokenizer.encode(TEXT))
    other = torch.tensor(lm.tokenizer.encode("Hello, world! This is a tiny tokenizer for tests."))

    def run(batched: bool) -> list[torch.Tensor]:
        kv = _kv(lm)
        chunks = [SeqChunk(0, 0, mine)] + ([SeqChunk(1, 0, other)] if batched else [])
        rows = [lm.model.forward_chunks(chunks, kv)[0]]
        token = int(rows[-1].argmax())
        for step in range(4):
            chunks = [SeqChunk(0, len(mine) + step, torch.tensor([token]))]
            if batched:
                chunks.insert(0, SeqChunk(1, len(other) + step, torch.tensor([5 + step])))
            logits = lm.model.forward_chunks(chunks, kv)
            rows.append(logits[len(chunks) - 1])
            token = int(rows[-1].argmax())
        return rows

    for step, (a, b) in enumerate(zip(run(False), run(True), strict=True)):
        assert torch.equal(a, b), f"{arch} step {step}: logits differ by {_max_diff(a, b):.3g} when batched"


def test_layer_split_over_two_stages_equals_one_stage(moe_models, loaded):
    one = loaded("qwen2_moe")
    path = moe_models["qwen2_moe"]
    two = load_model(path, plan_stages(read_model_config(path).n_layers, "cpu,cpu", "1,2"), torch.float32)
    ids = torch.tensor(one.tokenizer.encode(TEXT))
    a = one.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(one))
    b = two.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(two))
    assert torch.equal(a, b), f"max diff {_max_diff(a, b):.3g}"


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "granitemoe"])
def test_routing_ties_resolve_as_in_transformers(tmp_path, arch):
    """Every expert's router row the same: all experts tie for every token, and the experts picked (so the
    logits) are transformers' own."""
    path = write_tiny_moe_model(tmp_path, arch, same_router_rows=True)
    lm = _load(path)
    ids = torch.tensor(lm.tokenizer.encode(TEXT))[:40]
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(ids[None]).logits[0]
    ours = lm.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(lm), all_logits=True)[0]
    assert _max_diff(ours, ref) <= ATOL


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_gguf_conversion_loads_the_same_model(tmp_path, arch):
    """An unquantised GGUF with llama.cpp's expert tensors (ffn_*_exps, ffn_gate_inp, ffn_*_shexp) and
    metadata (expert_count, expert_used_count, ...) gives the logits of the HF folder it came from."""
    gguf_path = write_tiny_moe_gguf(tmp_path, arch)
    from_gguf, from_folder = _load(gguf_path), _load(str(tmp_path / f"tiny-{arch}"))
    assert from_gguf.config.architecture == arch
    for field in dataclasses.fields(from_folder.config.moe):  # GGUF keeps Granite's multipliers in float32
        got, want = getattr(from_gguf.config.moe, field.name), getattr(from_folder.config.moe, field.name)
        assert got == (pytest.approx(want, rel=1e-6) if isinstance(want, float) else want), field.name
    ids = torch.tensor(from_folder.tokenizer.encode(TEXT))
    a = from_gguf.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(from_gguf), all_logits=True)[0]
    b = from_folder.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(from_folder), all_logits=True)[0]
    diff = _max_diff(a, b)
    assert diff <= ATOL, f"{arch}: GGUF vs HF folder max abs logit diff {diff:.3g}"


def test_q8_0_gguf_experts_dequantise_to_the_folder_model(tmp_path):
    """Expert stacks stored quantised (Q8_0, 3-D) read back expert by expert: every expert matrix (and the
    shared expert) equals the folder's within Q8_0's rounding (an expert out of place would differ by ~140%)."""
    gguf_path = write_tiny_moe_gguf(tmp_path, "qwen2_moe", quantize=True)
    from_gguf, from_folder = _load(gguf_path), _load(str(tmp_path / "tiny-qwen2_moe"))
    for i, (a, b) in enumerate(zip(from_gguf.model.layers, from_folder.model.layers, strict=True)):
        for name in ("router", "gate_up", "down", "shared_gate_up", "shared_down"):  # router: + shared gate row
            got, want = getattr(a.moe, name), getattr(b.moe, name)
            assert got.shape == want.shape, (i, name)
            per_expert = (got - want).flatten(1).norm(dim=1) / want.flatten(1).norm(dim=1)
            assert per_expert.max().item() < 0.01, f"layer {i} {name}: relative error {per_expert.max():.3g}"
    ids = torch.tensor(from_folder.tokenizer.encode(TEXT))
    logits = from_gguf.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(from_gguf))
    assert torch.isfinite(logits).all()


def test_expert_bytes_count_the_routed_experts(loaded, tmp_path):
    """The expert arena a model reports: every routed expert's weights, not the dense MLPs or shared expert."""
    lm = loaded("olmoe")
    c = lm.config
    per_layer = N_EXPERTS * 3 * c.hidden_size * EXPERT_SIZE * 4  # float32 gate, up, down of every expert
    assert lm.model.expert_bytes == c.n_layers * per_layer
    assert loaded("qwen3_moe").model.expert_bytes == 2 * per_layer  # one of its three layers is dense
    assert loaded("qwen2_moe").model.expert_bytes == c.n_layers * per_layer  # the shared expert is not counted
    assert _load(write_tiny_model(tmp_path, "llama")).model.expert_bytes == 0


def test_unsupported_expert_settings_are_refused_with_the_reason(tmp_path):
    path = write_tiny_moe_model(tmp_path, "olmoe", clip_qkv=8.0)
    with pytest.raises(ModelLoadError, match="clip_qkv 8.0: clipping q/k/v is not supported"):
        read_model_config(path)


def test_serves_a_chat_completion(moe_models):
    with engine_process("--model", moe_models["qwen3_moe"], "--parallel", "2", "--ctx-size", "512",
                        "--conversation-cache-mib", "0") as engine:
        client = openai.OpenAI(base_url=engine.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hello, world!"}],
                                           max_tokens=6, temperature=0)
    [choice] = r.choices
    assert choice.finish_reason in ("stop", "length")
    assert 1 <= r.usage.completion_tokens <= 6
    assert isinstance(choice.message.content, str)



@pytest.mark.skipif(not int4.available(), reason="this torch has no CPU int4 kernels")
@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_int4_experts_track_float(tmp_path, arch):
    """Experts (and the shared expert) as 4-bit groups: on weights that lie on a 4-bit grid, the expert block
    stays within the bfloat16-activation error test_int4_weights allows a 4-bit matmul, and the greedy token
    mostly stays (a few tokens of a random model have experts so close that bfloat16 changes the choice)."""
    lm = _load(write_tiny_moe_model(tmp_path, arch, int4_grid=True))
    ids = torch.tensor(lm.tokenizer.encode(TEXT))
    block = lm.model.layers[0].moe
    h = torch.randn(50, lm.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ref_block = block(h, 0)
        ref = lm.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(lm), all_logits=True)[0]
        float_bytes = lm.model.expert_bytes
        for layer in lm.model.layers:
            layer.moe.quantize_experts()
        got_block = block(h, 0)
        got = lm.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(lm), all_logits=True)[0]
    assert isinstance(block.gate_up[N_EXPERTS - 1], int4.Int4Weight) and isinstance(block.down[0], int4.Int4Weight)
    assert isinstance(block.shared_gate_up, int4.Int4Weight) == (arch == "qwen2_moe")
    assert lm.model.expert_bytes < float_bytes / 5  # 4-bit codes plus a bfloat16 scale and zero per 32
    relative = ((got_block - ref_block).norm() / ref_block.norm()).item()
    assert relative < 0.03, f"{arch}: int4 experts change the block's output by {relative:.3f} (relative)"
    same = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert same >= 0.8, f"{arch}: int4 experts keep the greedy token at only {same:.0%} of positions"


@pytest.mark.skipif(not int4.available(), reason="this torch has no CPU int4 kernels")
def test_int4_engine_packs_the_experts_and_decodes_deterministically(moe_models):
    engine = Engine.from_config(EngineConfig(model=moe_models["qwen2_moe"], cpu_weights="int4",
                                             conversation_cache_mib=0))
    try:
        moe = engine.model.layers[1].moe
        assert isinstance(moe.gate_up[0], int4.Int4Weight) and isinstance(moe.shared_down, int4.Int4Weight)
        prompt = engine.tokenizer.encode("a harbour at dawn")
        runs = [[e.token_id for e in engine.submit(GenerationRequest(
            "t", prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))) if e.token_id is not None]
            for _ in range(2)]
    finally:
        engine.close()
    assert len(runs[0]) == 12 and runs[0] == runs[1]


def test_conversation_cache_restores_a_moe_conversation_exactly(moe_models):
    """A/B/A on a MoE model (int4 experts, the CPU default): A's parked K/V restored after B gives the tokens of
    A run straight through. The storage modes themselves do not depend on the model (tests/test_cache_*)."""
    base = {"model": moe_models["qwen2_moe"], "ctx_size": 2048, "conversation_cache_storage": "ram",
            "conversation_cache_min_free_mib": 0}
    outcome = run_scenario("basic", base, n_words=60, max_tokens=12)
    assert outcome.passed, outcome.detail
