"""Multi-head latent attention (DeepSeek-V3 `deepseek_v3`, GLM-4.7-Flash `glm4_moe_lite`): tiny random models
against transformers' own, the compact latent in the K/V store, and what is refused."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

ATOL = 1e-4  # float32 on both sides; the absorbed attention only sums in another order (engine/model/mla.py)
TEXT = "The quick brown fox jumps over the lazy dog. def add(a, b): return a + b  café 🙂 " * 2 + "Paris is"


def _load(path: str, **kwargs):
    from engine.model import load_model, plan_stages
    from engine.model.loader import read_model_config

    return load_model(path, plan_stages(read_model_config(path).n_layers, "cpu", ""), torch.float32, **kwargs)


def _kv(lm, n_slots: int = 2):
    from engine.kv import KVBuffers, KVLayout

    c = lm.config
    return KVBuffers(KVLayout(c.n_layers, c.kv_row[0], c.kv_row[1], lm.dtype), n_slots, 256, lm.model.stages)


def _reference(path: str, ids: torch.Tensor) -> torch.Tensor:
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids[None]).logits[0]


@pytest.fixture(scope="module", params=["deepseek_v3", "glm4_moe_lite"])
def family(request, tmp_path_factory):
    """(folder, loaded model, ids, transformers' logits) of a tiny model of each family."""
    from tests.mla_fixtures import write_tiny_mla_model

    folder = write_tiny_mla_model(tmp_path_factory.mktemp(request.param), request.param)
    lm = _load(folder)
    ids = torch.tensor(lm.tokenizer.encode(TEXT))
    return folder, lm, ids, _reference(folder, ids)


def test_the_config_is_read_and_the_cpu_steps_decline_latent_attention(family):
    from engine.model import executors

    _, lm, _, _ = family
    c = lm.config
    m = c.mla
    assert (m.kv_lora_rank, m.qk_rope_head_dim, m.qk_nope_head_dim, m.v_head_dim, m.q_lora_rank) == (24, 8, 16, 12, 32)
    assert (c.n_kv_heads, c.head_dim, c.kv_row) == (1, 8, (1, 16))
    assert m.softmax_scale == pytest.approx(24**-0.5)
    assert c.moe.dense_layers == (0,) and c.moe.routing == "sigmoid_bias" and c.moe.shared_expert_size == 32
    assert [layer.moe is not None for layer in lm.model.layers] == [False, True, True]
    assert "latent attention" in lm.model.description.features()
    assert executors.layer_declines(executors.EAGER, lm.model.description) is None
    assert executors.cpu_step_declines(lm.model) == "latent attention"
    assert executors.native_step_declines(lm.model) == "latent attention"
    assert executors.layer_declines(executors.GRAPH_STEP, lm.model.description) is None
    assert c.describe()["mla"]["stored"] == "latent"  # the cache identity names the latent layout


def test_logits_match_transformers_one_shot_chunked_and_decoding(family):
    from engine.model import SeqChunk

    _, lm, ids, ref = family
    assert len(ids) >= 90
    ours = lm.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(lm), all_logits=True)[0]
    assert (ours - ref).abs().max().item() <= ATOL
    kv, n = _kv(lm), len(ids)
    cuts = [0, 7, 40, n - 4]
    for a, b in zip(cuts, cuts[1:], strict=False):
        got = lm.model.forward_chunks([SeqChunk(1, a, ids[a:b])], kv, all_logits=True)[0]
        assert (got - ref[a:b]).abs().max().item() <= ATOL, f"prefill chunk [{a},{b})"
    for pos in range(n - 4, n):
        got = lm.model.forward_chunks([SeqChunk(1, pos, ids[pos : pos + 1])], kv)[0]
        assert (got - ref[pos]).abs().max().item() <= ATOL, f"decode at {pos}"
        assert got.argmax().item() == ref[pos].argmax().item()


def test_the_store_keeps_the_latent_alone_and_a_batch_computes_each_slot_as_alone(family):
    """A token costs kv_lora_rank + qk_rope_head_dim values per layer (not 2 x heads x head widths), and the
    latent rows a prefill wrote are what a slot's decode reads: two slots decoding together get their own
    logits."""
    from engine.model import SeqChunk

    _, lm, ids, ref = family
    c, m = lm.config, lm.config.mla
    kv = _kv(lm)
    assert kv.layout.bytes_per_token == c.n_layers * m.latent_width * 4
    expanded = c.n_layers * c.n_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * 4
    assert kv.layout.bytes_per_token * 4 < expanded  # 384 against 1,728 bytes a token for the tiny model
    n = len(ids)
    lm.model.forward_chunks([SeqChunk(0, 0, ids[: n - 1]), SeqChunk(1, 0, ids[: n - 2])], kv)
    both = lm.model.forward_chunks([SeqChunk(0, n - 1, ids[n - 1 :]), SeqChunk(1, n - 2, ids[n - 2 : n - 1])], kv)
    assert (both[0] - ref[n - 1]).abs().max().item() <= ATOL and (both[1] - ref[n - 2]).abs().max().item() <= ATOL


def test_direct_q_projection_rope_in_halves_and_an_odd_latent_match_transformers(tmp_path):
    """q_lora_rank null (q_proj straight from the hidden state), rope_interleave false, a latent of odd width
    (23 + 8: its V row is zero-padded), and YaRN with DeepSeek's mscale and mscale_all_dim (the tables' attention
    factor, the softmax scale times mscale_all_dim's factor squared)."""
    from engine.model import SeqChunk
    from tests.mla_fixtures import write_tiny_mla_model

    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.8, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}
    path = write_tiny_mla_model(tmp_path, "deepseek_v3", q_lora_rank=None, rope_interleave=False, kv_lora_rank=23,
                                rope_parameters=yarn, seed=1)
    lm = _load(path)
    assert lm.config.mla.q_lora_rank is None and lm.config.kv_row == (1, 16)
    assert lm.config.mla.softmax_scale == pytest.approx(24**-0.5 * (0.1 * math.log(4.0) + 1.0) ** 2)
    ids = torch.tensor(lm.tokenizer.encode(TEXT))
    ref = _reference(path, ids)
    kv = _kv(lm)
    ours = lm.model.forward_chunks([SeqChunk(0, 0, ids[:-1])], kv, all_logits=True)[0]
    assert (ours - ref[:-1]).abs().max().item() <= ATOL
    last = lm.model.forward_chunks([SeqChunk(0, len(ids) - 1, ids[-1:])], kv)[0]
    assert (last - ref[-1]).abs().max().item() <= ATOL


@pytest.mark.parametrize(("change", "message"), [
    ({"attention_bias": True}, r"attention_bias true: biases on the latent projections are not supported"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
     r"quantization_config 'fp8': quantised checkpoints are not read"),
    ({"qk_rope_head_dim": 7}, r"qk_rope_head_dim: expected an even number \(RoPE turns pairs\), got 7"),
    ({"kv_lora_rank": 0}, r"kv_lora_rank: expected a positive whole number, got 0"),
    ({"mlp_layer_types": ["dense", "sparse"]}, r"mlp_layer_types: expected \"dense\" or \"sparse\" for each of the 3"),
])
def test_configs_it_cannot_run_are_refused_with_the_reason(family, tmp_path, change, message):
    from engine.errors import ModelLoadError
    from engine.model.loader import read_model_config

    folder = family[0]
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    cfg = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ModelLoadError, match=message):
        read_model_config(str(copy))


def test_deepseek_v3_config_json_is_read_as_released():
    """DeepSeek-V3's own config.json (transformers 4.x keys, YaRN with mscale_all_dim): the softmax scale takes
    YaRN's mscale squared, as transformers' yarn_apply_mscale."""
    from engine.model.config import ModelConfig

    v3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
          "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
          "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
          "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
          "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
          "first_k_dense_replace": 3, "norm_topk_prob": True, "hidden_act": "silu", "max_position_embeddings": 163840,
          "rms_norm_eps": 1e-06, "rope_theta": 10000, "vocab_size": 129280, "tie_word_embeddings": False,
          "attention_bias": False, "num_nextn_predict_layers": 1,
          "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                           "original_max_position_embeddings": 4096, "type": "yarn"}}
    c = ModelConfig.from_hf(v3)
    mscale = 0.1 * math.log(40) + 1.0
    assert c.mla.softmax_scale == pytest.approx(192**-0.5 * mscale**2)
    assert (c.head_dim, c.kv_row, c.moe.dense_layers, c.moe.n_group, c.moe.topk_group) == (64, (1, 288), (0, 1, 2), 8, 4)
    # 61 layers x 576 bfloat16 values: 70,272 bytes a token, against 61 x 128 x (192 + 128) x 2 = 4,997,120 expanded
    assert c.n_layers * 2 * c.kv_row[1] * 2 == 70272


def test_int4_weights_track_float(tmp_path):
    """`--cpu-weights int4`: the fused first projection (q_a and kv_a, RoPE rows reordered before packing), the
    output projection and the experts as 4-bit groups; q_b and kv_b stay float. On weights that lie on a 4-bit
    grid the greedy token stays (what differs is the kernel's bfloat16 activations)."""
    from engine.model import SeqChunk, int4
    from tests.mla_fixtures import write_tiny_mla_model

    if not int4.available():
        pytest.skip("this torch has no CPU int4 kernels")
    path = write_tiny_mla_model(tmp_path, "deepseek_v3", int4_grid=True, v_head_dim=16)  # o_proj: 64 columns
    ref_lm, lm = _load(path), _load(path, int4_weights=True)
    assert isinstance(lm.model.layers[1].wqkv, int4.Int4Weight) and isinstance(lm.model.layers[1].wo, int4.Int4Weight)
    ids = torch.tensor(lm.tokenizer.encode(TEXT))
    ref, got = (x.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(x), all_logits=True)[0] for x in (ref_lm, lm))
    same = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert same >= 0.9, f"int4 weights keep the greedy token at only {same:.0%} of positions"


# ---------------------------------------------------------------- the GGUF llama.cpp's converter writes

@pytest.mark.parametrize(("arch", "split_kv_b"), [("deepseek_v3", True), ("glm4_moe_lite", False)])
def test_its_deepseek2_gguf_loads_to_the_same_logits(tmp_path, arch, split_kv_b):
    """llama.cpp's `deepseek2` file (both families convert to it): kv_b split into attn_k_b / attn_v_b as recent
    converters write it, or whole as older ones did; RoPE rows left interleaved. The same latent settings and
    experts as the HF folder, and the same logits."""
    from engine.model import SeqChunk
    from tests.mla_fixtures import write_tiny_mla_gguf

    path = write_tiny_mla_gguf(tmp_path, arch, split_kv_b=split_kv_b)
    folder_lm, file_lm = _load(path.removesuffix(".gguf")), _load(path)
    assert file_lm.config.architecture == "deepseek_v3" and file_lm.config.mla == folder_lm.config.mla
    assert file_lm.config.kv_row == folder_lm.config.kv_row and file_lm.config.moe.dense_layers == (0,)
    ids = torch.tensor(folder_lm.tokenizer.encode(TEXT))
    a, b = (x.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(x), all_logits=True)[0] for x in (folder_lm, file_lm))
    assert (a - b).abs().max().item() <= ATOL


def test_a_q8_0_deepseek2_gguf_reads_its_latent_projections_in_place(tmp_path):
    """A quantised file (Q8_0 matrices, kv_b split): the RoPE'd rows of q_b and kv_a_mqa reordered from the
    file's values, k_b / v_b joined, every attention matrix the folder's within Q8_0's rounding (a row out of
    place would differ by ~100%); with `--cpu-weights int4` the fused first projection is 8-bit rows built from
    those values, not the file's blocks, and the model runs."""
    from engine.model import SeqChunk, int4, q8_weight
    from engine.model.q8_weight import Q8Weight
    from tests.mla_fixtures import write_tiny_mla_gguf

    path = write_tiny_mla_gguf(tmp_path, "deepseek_v3", quantize=True, v_head_dim=16)
    folder_lm, file_lm = _load(path.removesuffix(".gguf")), _load(path)
    for i, (a, b) in enumerate(zip(folder_lm.model.layers, file_lm.model.layers, strict=True)):
        for name, want, got in (("wqkv", a.wqkv, b.wqkv), ("wo", a.wo, b.wo), ("q_b", a.mla.q_b, b.mla.q_b),
                                ("w_uk", a.mla.w_uk, b.mla.w_uk), ("w_uv", a.mla.w_uv, b.mla.w_uv)):
            error = ((got - want).norm() / want.norm()).item()
            assert error < 0.01, f"layer {i} {name}: relative error {error:.3g}"
    if int4.available() and q8_weight.available():
        packed = _load(path, int4_weights=True)
        assert isinstance(packed.model.layers[1].wqkv, Q8Weight)
        ids = torch.tensor(folder_lm.tokenizer.encode(TEXT))
        assert torch.isfinite(packed.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(packed))).all()


def test_a_deepseek2_gguf_with_softmax_routing_is_refused(tmp_path):
    """DeepSeek-V2's files (softmax routing) are deepseek2 too; this engine runs V3's sigmoid routing only."""
    import gguf

    from engine.errors import ModelLoadError
    from engine.model.loader import read_model_config
    from tests.mla_fixtures import write_tiny_mla_gguf

    path = write_tiny_mla_gguf(tmp_path, "deepseek_v3")
    reader = gguf.GGUFReader(path, "r+")
    field = reader.fields["deepseek2.expert_gating_func"]
    field.parts[field.data[0]][0] = 1  # softmax, written in place
    del reader
    with pytest.raises(ModelLoadError, match=r"expert_gating_func 1: expected 2 \(sigmoid\) for deepseek2"):
        read_model_config(path)


# ---------------------------------------------------------------- the conversation cache parks the latent

@pytest.mark.slow
@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe_lite"])
def test_a_parked_latent_resumes_exactly_in_ram_disk_tiered_and_after_a_restart(arch, tmp_path):
    """tools/conversation_cache_parity.py on each family: a conversation parked and restored (RAM, disk, tiered,
    and tiered across an engine restart) continues token for token as one that never left, its restored latent
    rows byte-identical; with `--moe-experts cpu` (experts in host RAM as 4-bit groups) for DeepSeek-V3."""
    from engine.model import int4
    from tests.mla_fixtures import write_tiny_mla_model
    from tools.conversation_cache_parity import run_restart, run_scenario

    folder = write_tiny_mla_model(tmp_path, arch)
    experts = "cpu" if arch == "deepseek_v3" and int4.available() else "gpu"
    base = {"model": folder, "devices": "cpu", "ctx_size": 512, "cpu_weights": "float", "moe_experts": experts,
            "conversation_cache_min_free_mib": 0, "prefill_chunk": 32}
    for storage in ("ram", "disk", "tiered"):
        outcome = run_scenario("basic", {**base, "conversation_cache_storage": storage}, n_words=40, max_tokens=8)
        assert outcome.passed, f"{storage}: {outcome.detail}"
    outcome = run_restart({**base, "conversation_cache_storage": "tiered"}, {}, n_words=40, max_tokens=8)
    assert outcome.passed, outcome.detail


def test_a_deepseek_v3_gguf_tokenizer_splits_text_as_llama_cpp_does():
    """llama.cpp's `deepseek-v3` pre-tokenizer: digits in threes, then runs of CJK, then words with a leading
    punctuation mark, each expression splitting the pieces of the one before."""
    from engine.model.tokenizer import Tokenizer

    tokens = [chr(c) for c in range(33, 127)] + ["Ġ"]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "deepseek-v3", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.merges": [], "tokenizer.ggml.token_type": [1] * len(tokens)}
    backend = Tokenizer.from_gguf_metadata(meta).backend
    pieces = [p for p, _ in backend.pre_tokenizer.pre_tokenize_str("n 1234567 IT'S .hello 日本abc")]
    assert pieces == ["n", "Ġ", "123", "456", "7", "ĠIT", "'S", "Ġ.", "hello", "Ġ", "æĹ¥æľ¬", "abc"]


def test_the_captured_decode_step_matches_forward_chunks(family):
    """The function a CUDA graph captures (graph_decode.decode_step, plain PyTorch, run here on the CPU): three
    slots at different positions padded to a bucket of 4, the same logits and latent rows as the eager pass."""
    from engine.model import SeqChunk, executors
    from engine.model.graph_decode import GraphDecode

    _, lm, _, _ = family
    assert executors.layer_declines(executors.GRAPH_STEP, lm.model.description) is None
    kv_ref, kv_new = _kv(lm, 4), _kv(lm, 4)
    gen = torch.Generator().manual_seed(1)
    prompts = {0: 20, 1: 3, 3: 140}  # slot -> prompt length
    for slot, n in prompts.items():
        ids = torch.randint(0, lm.config.vocab_size, (n,), generator=gen)
        for kv in (kv_ref, kv_new):
            lm.model.forward_chunks([SeqChunk(slot, 0, ids)], kv)
    runner = GraphDecode(lm.model, 4, capture=False)
    for step in range(3):
        chunks = [SeqChunk(slot, n + step, torch.tensor([7 + slot + step])) for slot, n in prompts.items()]
        expected = lm.model.forward_chunks(chunks, kv_ref)
        got = runner.run(chunks, kv_new)
        assert got is not None
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.argmax(-1), expected.argmax(-1))
    for slot, n in prompts.items():
        torch.testing.assert_close(kv_new.read(slot, 0, n + 3), kv_ref.read(slot, 0, n + 3), rtol=1e-5, atol=1e-5)
    assert kv_new.read(2, 0, 256).abs().sum() == 0  # the slot no row uses is untouched


def test_the_cache_identity_names_the_latent_layout(family):
    """Parked latents are another model's K/V for every other layout: the identity (folder, keys, file headers)
    carries the latent settings and the one-head layout of the latent's halves."""
    from engine.kv import KVLayout
    from engine.runtime.identity import cache_identity
    from engine.runtime.memory import AttentionMemory

    _, lm, _, _ = family
    kv = _kv(lm)
    identity = cache_identity(lm, "float", "", kv.layout, 16, AttentionMemory(kv))
    assert identity.model["mla"]["stored"] == "latent" and identity.model["mla"]["kv_lora_rank"] == 24
    assert identity.layout == KVLayout(lm.config.n_layers, 1, 16, torch.float32)


@pytest.mark.slow
def test_the_conversation_list_gives_a_parked_latent_conversation_its_bytes(tmp_path):
    """`/cache/conversations`' bytes of a parked conversation: its tokens x (layers x latent values x the K/V
    dtype's bytes + 4 for the token id), nothing per head."""
    from engine.config import EngineConfig
    from engine.runtime.engine import Engine
    from tests.mla_fixtures import write_tiny_mla_model
    from tools.hybrid_switch_bench import ask

    folder = write_tiny_mla_model(tmp_path, "glm4_moe_lite")
    engine = Engine.from_config(EngineConfig(model=folder, devices="cpu", ctx_size=256, kv_dtype="bfloat16",
                                             conversation_cache_storage="ram", conversation_cache_min_free_mib=0))
    try:
        a = torch.randint(3, 300, (70,), generator=torch.Generator().manual_seed(1)).tolist()
        ask(engine, a)
        ask(engine, a[::-1])  # takes the one slot: the first conversation is parked
        rows = engine.call(engine.cache_conversations).result()
        parked = [r for r in rows if r["bytes"]]
        assert parked, rows
        c = engine.cache.identity.model["mla"]
        per_token = 3 * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * 2 + 4
        assert all(r["bytes"] == r["tokens"] * per_token for r in parked), (parked, per_token)
    finally:
        engine.close()
