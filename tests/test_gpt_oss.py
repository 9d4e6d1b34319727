"""gpt-oss (transformers' GptOssConfig, llama.cpp's `gpt-oss`): its expert block against transformers' own (biased
router, top-k then softmax, biased experts with the clamped SwiGLU), its attention sinks, and the whole tiny
model against transformers: one shot, chunked, decoding; from its HF folder and from its GGUF with MXFP4 experts."""

from __future__ import annotations

import pytest
import torch

from engine.model.moe import SparseMoe
from engine.model.moe_config import MoeConfig, gpt_oss_experts

transformers = pytest.importorskip("transformers")

ATOL = 1e-4  # float32 on both sides; only summation orders differ (tests/test_moe_models.py)
TEXT = "The quick brown fox jumps over the lazy dog. def add(a, b): return a + b  café 🙂 " * 2 + "Paris is"
HIDDEN = 32


def _moe_config(cfg) -> MoeConfig:
    return gpt_oss_experts({"n_experts": cfg.num_local_experts, "top_k": cfg.num_experts_per_tok},
                           cfg.intermediate_size, cfg.swiglu_limit, cfg.swiglu_alpha)


def test_the_block_with_its_biases_and_clamped_swiglu_equals_transformers():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    from engine.model.moe_loading import gpt_oss_hf_layout

    cfg = transformers.GptOssConfig(hidden_size=HIDDEN, intermediate_size=16, num_local_experts=8,
                                    num_experts_per_tok=3, swiglu_limit=0.8)
    torch.manual_seed(0)
    block = GptOssMLP(cfg).eval()
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.5)
    e = block.experts

    def canonical(key: str, t: torch.Tensor) -> torch.Tensor:
        return gpt_oss_hf_layout("0." + key, t.detach().clone())

    moe = SparseMoe(_moe_config(cfg), HIDDEN, router=block.router.weight.detach().clone(),
                    router_bias=block.router.bias.detach().clone(),
                    gate_up=canonical("experts.gate_up", e.gate_up_proj), down=canonical("experts.down", e.down_proj),
                    gate_up_bias=canonical("experts.gate_up_bias", e.gate_up_proj_bias),
                    down_bias=e.down_proj_bias.detach().clone())
    h = torch.randn(40, HIDDEN)
    with torch.no_grad():
        ref = block(h[None])[0][0]
        gate_up = h @ e.gate_up_proj[0] + e.gate_up_proj_bias[0]
    assert (gate_up[:, 0::2] > cfg.swiglu_limit).any() and (gate_up[:, 1::2].abs() > cfg.swiglu_limit).any()
    got = moe(h, 0)
    assert (got - ref).abs().max().item() <= 1e-5
    one = moe(h[:1], 1)  # a decode row alone computes what it does among others
    assert (one - got[:1]).abs().max().item() <= 1e-5


def test_a_clamped_swiglu_needs_both_settings_and_positive_values():
    with pytest.raises(ValueError, match="swiglu_limit: expected a positive number, got -1"):
        gpt_oss_experts({"n_experts": 4, "top_k": 2}, 16, -1, 1.702)
    with pytest.raises(ValueError, match="expected both"):
        MoeConfig(n_experts=4, top_k=2, expert_size=16, routing="topk_softmax", norm_topk_prob=False,
                  swiglu_limit=7.0).check(2)


def test_the_moe_families_from_before_gpt_oss_keep_their_identity():
    m = MoeConfig(n_experts=8, top_k=2, expert_size=32, routing="softmax_topk", norm_topk_prob=True)
    assert not {"router_bias", "expert_biases", "swiglu_limit", "swiglu_alpha"} & m.describe().keys()


def test_sink_attention_is_a_softmax_with_one_more_logit_per_head():
    from engine.model.chunk_attention import sink_attention

    torch.manual_seed(0)
    q, k, v = torch.randn(5, 4, 8), torch.randn(2, 9, 8), torch.randn(2, 9, 8)
    sinks = torch.randn(4)
    mask = torch.rand(5, 9) > 0.3
    mask[:, 0] = True
    got = sink_attention(q, k, v, mask, False, None, sinks)
    for head in range(4):
        kv = head // 2
        scores = (q[:, head] @ k[kv].T) / 8**0.5
        scores = scores.masked_fill(~mask, float("-inf"))
        weights = torch.exp(scores) / (torch.exp(scores).sum(-1, keepdim=True) + torch.exp(sinks[head]))
        assert torch.allclose(got[:, head], weights @ v[kv], atol=1e-6)


def test_a_long_chunk_attends_in_blocks_of_queries_to_the_same_result(monkeypatch):
    from engine.model import chunk_attention

    torch.manual_seed(1)
    q, k, v, sinks = torch.randn(40, 4, 8), torch.randn(2, 40, 8), torch.randn(2, 40, 8), torch.randn(4)
    whole = chunk_attention.sink_attention(q, k, v, None, True, 0.3, sinks)
    monkeypatch.setattr(chunk_attention, "SINK_SCORES", 4 * 40 * 7)  # blocks of 7 queries
    assert torch.allclose(chunk_attention.sink_attention(q, k, v, None, True, 0.3, sinks), whole, atol=1e-6)


def _load(path: str, **kwargs):
    from engine.model import load_model, plan_stages
    from engine.model.loader import read_model_config

    return load_model(path, plan_stages(read_model_config(path).n_layers, "cpu", ""), torch.float32, **kwargs)


def _kv(lm):
    from engine.kv import KVBuffers, KVLayout

    c = lm.config
    return KVBuffers(KVLayout(c.n_layers, c.n_kv_heads, c.head_dim, lm.dtype), 3, 256, lm.model.stages)


def _reference(folder: str, ids: torch.Tensor) -> torch.Tensor:
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.config._attn_implementation = "eager"  # gpt-oss's own attention, sinks included
    with torch.no_grad():
        return model(ids[None]).logits[0]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    from tests.gpt_oss_fixtures import write_tiny_gpt_oss

    return write_tiny_gpt_oss(tmp_path_factory.mktemp("gpt-oss"))


@pytest.fixture(scope="module")
def lm(folder):
    return _load(folder)


def test_the_config_is_read_as_gpt_oss_describes_its_layers(lm):
    from engine.model import executors

    c = lm.config
    assert (c.architecture, c.head_dim, c.attention_bias, c.sliding_window, c.sliding_layers) == (
        "gpt_oss", 16, True, 8, (0, 2))
    assert c.rope_theta == 150000.0 and c.rope_scaling["rope_type"] == "yarn" and c.rope_scaling["truncate"] is False
    m = c.moe
    assert (m.routing, m.router_bias, m.expert_biases, m.swiglu_limit, m.swiglu_alpha, m.dense_layers) == (
        "topk_softmax", True, True, 1.0, 1.702, ())
    features = lm.model.description.features()
    assert {"attention sinks", "output bias", "router bias", "clamped SwiGLU", "sliding window"} <= features
    assert executors.layer_declines(executors.EAGER, lm.model.description) is None
    reason = "attention sinks, output bias, router bias or clamped SwiGLU experts (gpt-oss layers)"
    assert executors.cpu_step_declines(lm.model) == reason
    assert executors.layer_declines(executors.NATIVE_STEP, lm.model.description) is None  # its weights decide


def test_logits_match_transformers_one_shot_chunked_and_decoding(folder, lm):
    from engine.model import SeqChunk

    ids = torch.tensor(lm.tokenizer.encode(TEXT))
    ref = _reference(folder, ids)
    n = len(ids)
    assert n >= 90  # well past the window of 8
    ours = lm.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(lm), all_logits=True)[0]
    assert (ours - ref).abs().max().item() <= ATOL
    kv = _kv(lm)
    cuts = [0, 5, 13, 40, n - 4]
    for a, b in zip(cuts, cuts[1:], strict=False):
        got = lm.model.forward_chunks([SeqChunk(1, a, ids[a:b])], kv, all_logits=True)[0]
        assert (got - ref[a:b]).abs().max().item() <= ATOL, f"prefill chunk [{a},{b})"
    for pos in range(n - 4, n):
        got = lm.model.forward_chunks([SeqChunk(1, pos, ids[pos : pos + 1])], kv)[0]
        assert (got - ref[pos]).abs().max().item() <= ATOL, f"decode at {pos}"
        assert got.argmax().item() == ref[pos].argmax().item()


@pytest.mark.parametrize(("change", "message"), [
    ({"swiglu_limit": 0}, r"swiglu_limit: expected a positive number, got 0"),
    ({"swiglu_alpha": "x"}, r"swiglu_alpha: expected a positive number, got 'x'"),
    ({"layer_types": ["sliding_attention"]}, r"layer_types lists 1 layers, the model has 4"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
])
def test_configs_it_cannot_run_are_refused_with_the_reason(folder, tmp_path, change, message):
    import json
    import shutil

    from engine.errors import ModelLoadError
    from engine.model.loader import read_model_config

    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    cfg = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ModelLoadError, match=message):
        read_model_config(str(copy))


def test_a_checkpoint_with_mxfp4_experts_loads_to_the_values_they_hold(tmp_path):
    """A released checkpoint's MXFP4 `*_blocks` / `*_scales`: decoded exactly (the same logits as the float
    checkpoint of the same values), and kept as MXFP4 rows when the experts are placed in host RAM: the bytes
    llama.cpp's converter writes to the GGUF."""
    from engine.model import SeqChunk, kquant_weight
    from tests.gpt_oss_fixtures import write_tiny_gpt_oss

    packed = _load(write_tiny_gpt_oss(tmp_path, hf_mxfp4=True))
    plain = _load(write_tiny_gpt_oss(tmp_path, mxfp4_grid=True))
    ids = torch.tensor(plain.tokenizer.encode(TEXT))
    a, b = (x.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(x), all_logits=True)[0] for x in (packed, plain))
    assert torch.equal(a, b)
    if kquant_weight.available():
        from tests.gpt_oss_fixtures import write_tiny_gpt_oss_gguf

        placed = _load(write_tiny_gpt_oss(tmp_path, hf_mxfp4=True), cpu_experts=frozenset(range(4)))
        from_file = _load(write_tiny_gpt_oss_gguf(tmp_path / "gguf"), cpu_experts=frozenset(range(4)))
        for ours, file in ((layer.moe, other.moe) for layer, other in zip(placed.model.layers, from_file.model.layers,
                                                                           strict=True)):
            assert all(isinstance(w, kquant_weight.MXFP4Weight) for w in (*ours.gate_up, *ours.down))
            assert all(torch.equal(x.blocks, y.blocks) for x, y in zip((*ours.gate_up, *ours.down),
                                                                       (*file.gate_up, *file.down), strict=True))


def test_mxfp4_blocks_of_the_wrong_shape_are_refused_by_name():
    from engine.model import mxfp4

    with pytest.raises(ValueError, match=r"0.experts.down: MXFP4 blocks uint8 \[experts, rows, blocks, 16\]"):
        mxfp4.decode(torch.zeros(2, 4, 1, 16, dtype=torch.uint8), torch.zeros(2, 4, 2, dtype=torch.uint8),
                     "0.experts.down")


# ---------------------------------------------------------------- the GGUF llama.cpp's converter writes

@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory) -> str:
    from tests.gpt_oss_fixtures import write_tiny_gpt_oss_gguf

    return write_tiny_gpt_oss_gguf(tmp_path_factory.mktemp("gpt-oss-gguf"))


def test_its_gguf_with_mxfp4_experts_loads_to_the_same_logits(gguf_path):
    import gguf

    from engine.model import SeqChunk

    folder = gguf_path.removesuffix(".gguf") + "-mxfp4"
    reader = gguf.GGUFReader(gguf_path)
    types = {t.name: t.tensor_type.name for t in reader.tensors if "_exps.weight" in t.name}
    assert set(types.values()) == {"MXFP4"} and len(types) == 12
    del reader
    file_lm = _load(gguf_path)
    c = file_lm.config
    assert (c.architecture, c.sliding_window, c.sliding_layers) == ("gpt_oss", 8, (0, 2))
    assert c.rope_scaling["truncate"] is False and c.rope_scaling["factor"] == 32.0
    assert c.moe == _load(folder).config.moe
    ids = torch.tensor(file_lm.tokenizer.encode(TEXT))
    ref = _reference(folder, ids)
    ours = file_lm.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(file_lm), all_logits=True)[0]
    assert (ours - ref).abs().max().item() <= ATOL


# ---------------------------------------------------------------- experts in host RAM, parked conversations

def _parity_base(folder: str, storage: str) -> dict:
    return {"model": folder, "devices": "cpu", "ctx_size": 1024, "cpu_weights": "float", "moe_experts": "cpu",
            "conversation_cache_storage": storage, "conversation_cache_min_free_mib": 0,
            "conversation_cache_block_tokens": 16, "prefill_chunk": 32}


def test_experts_in_host_ram_are_4_bit_groups_beside_their_biases(folder):
    from engine.model import int4, moe_placement
    from engine.model.loader import read_model_config

    if not int4.available():
        pytest.skip("this torch has no CPU int4 kernels")
    layers = moe_placement.cpu_expert_layers(read_model_config(folder), "cpu", 0)
    assert layers == {0, 1, 2, 3}
    lm = _load(folder, cpu_experts=layers)
    moe = lm.model.layers[1].moe
    assert all(isinstance(w, int4.Int4Weight) for w in (*moe.gate_up, *moe.down))
    assert moe.expert_device.type == "cpu" and moe.gate_up_bias.device.type == "cpu"
    assert moe.router_bias is not None and lm.model.layers[1].sinks is not None


@pytest.mark.parametrize("storage", ["ram", "disk", "tiered"])
def test_a_parked_conversation_resumes_exactly_with_experts_in_host_ram(folder, storage):
    """`--moe-experts cpu`; a conversation parked (its full layers' K/V and its sliding layers' window) and
    restored continues as one that never left."""
    from engine.model import int4
    from tools.conversation_cache_parity import run_scenario

    if not int4.available():
        pytest.skip("this torch has no CPU int4 kernels")
    outcome = run_scenario("basic", _parity_base(folder, storage), n_words=40, max_tokens=8)
    assert outcome.passed, outcome.detail


def test_a_conversation_parked_in_tiered_storage_resumes_exactly_across_a_restart(folder):
    from engine.model import int4
    from tools.conversation_cache_parity import run_restart

    if not int4.available():
        pytest.skip("this torch has no CPU int4 kernels")
    outcome = run_restart(_parity_base(folder, "tiered"), {}, n_words=40, max_tokens=8)
    assert outcome.passed, outcome.detail


def test_its_mxfp4_experts_stay_the_files_blocks_in_host_ram_and_a_parked_conversation_resumes(gguf_path):
    """`--moe-experts cpu` from the GGUF: every expert is the file's MXFP4 rows (kernels/blocks.c's
    mxfp4_matmul, no conversion), within the int16 activations' rounding of transformers; and a conversation
    parked on disk resumes exactly."""
    from engine.model import SeqChunk, kquant_weight
    from tools.conversation_cache_parity import run_scenario

    if not kquant_weight.available():
        pytest.skip("no native kernels here")
    lm = _load(gguf_path, cpu_experts=frozenset(range(4)))
    moe = lm.model.layers[1].moe
    assert all(isinstance(w, kquant_weight.MXFP4Weight) for w in (*moe.gate_up, *moe.down))
    assert moe.expert_bytes == 8 * (2 * 32 * 64 + 64 * 32) // 32 * 17  # 17 bytes for 32 weights, as in the file
    ids = torch.tensor(lm.tokenizer.encode(TEXT))
    ref = _reference(gguf_path.removesuffix(".gguf") + "-mxfp4", ids)
    ours = lm.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(lm), all_logits=True)[0]
    assert (ours - ref).abs().max().item() <= 1e-2  # logits of magnitude ~10: the activations' int16 rounding
    outcome = run_scenario("basic", _parity_base(gguf_path, "disk"), n_words=40, max_tokens=8)
    assert outcome.passed, outcome.detail


def test_a_gpt_oss_gguf_tokenizer_splits_text_as_llama_cpp_does():
    """llama.cpp's `gpt-4o` pre-tokenizer (o200k's expression): a word splits before a capital, digits in threes,
    contractions stay with their word; the GPT-2 split would keep "HelloWorld" and "12345" whole."""
    from engine.model.tokenizer import Tokenizer

    tokens = [chr(c) for c in range(33, 127)] + ["Ġ"]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-4o", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.merges": [], "tokenizer.ggml.token_type": [1] * len(tokens)}
    backend = Tokenizer.from_gguf_metadata(meta).backend
    pieces = [p for p, _ in backend.pre_tokenizer.pre_tokenize_str("HelloWorld 12345 it's")]
    assert pieces == ["Hello", "World", "Ġ", "123", "45", "Ġit's"]


def test_gpt_oss_20b_config_json_is_read_as_released():
    """gpt-oss-20b's own config.json (transformers 4.x style: rope_scaling and rope_theta at the top level, no
    swiglu_alpha, the MXFP4 quantization_config of its expert blocks)."""
    from engine.model.config import ModelConfig

    released = {
        "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
        "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
        "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
        "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
        "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
        "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                           "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
        "rms_norm_eps": 1e-05,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                         "rope_type": "yarn", "truncate": False},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088,
    }
    c = ModelConfig.from_hf(released)
    assert (c.n_layers, c.head_dim, c.n_heads, c.n_kv_heads, c.rope_theta, c.sliding_window) == (
        24, 64, 64, 8, 150000.0, 128)
    assert c.sliding_layers == tuple(range(0, 24, 2))
    assert c.rope_scaling == {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                              "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False}
    m = c.moe
    assert (m.n_experts, m.top_k, m.expert_size, m.swiglu_limit, m.swiglu_alpha) == (32, 4, 2880, 7.0, 1.702)


def test_it_decodes_through_the_native_step_with_its_mxfp4_experts(gguf_path):
    """`--cpu-weights int4` from the GGUF: the experts as the file's MXFP4 rows, the rest in native 4-bit blocks;
    step.c's sink term and output bias and experts.c's biased router and clamped experts follow forward_chunks
    within the native step's tolerance, over sliding and full layers, two slots at once."""
    from engine.model import kquant_weight
    from engine.model.native_decode import NativeDecode
    from tests.int4_kernels import int4_kernel
    from tests.test_kquant_weights import _native_step_follows_forward_chunks

    with int4_kernel("blocks"):
        lm = _load(gguf_path, int4_weights=True)
        assert isinstance(lm.model.layers[0].moe.gate_up[0], kquant_weight.MXFP4Weight)
        _native_step_follows_forward_chunks(lm, {0: 20, 1: 13})
        assert NativeDecode(lm.model).owns_one_token_rows


# ---------------------------------------------------------------- on a GPU

def check_on_gpu(folder: str, gguf_path: str, device: str = "cuda:0") -> None:
    """The layers on a CUDA GPU in float32 (sink attention, the biases, the experts' loop) give the CPU's logits,
    one shot, chunked and decoding; so do GPU layers beside experts in host RAM as the GGUF's MXFP4 rows; and
    bfloat16 layers keep the greedy token."""
    from engine.model import SeqChunk, load_model, plan_stages

    def on_gpu(path: str, dtype: torch.dtype, experts: frozenset[int]):
        return load_model(path, plan_stages(4, device, ""), dtype, cpu_experts=experts)

    for path, experts in ((folder, frozenset()), (gguf_path, frozenset(range(4)))):
        cpu, gpu = _load(path, cpu_experts=experts), on_gpu(path, torch.float32, experts)
        ids = torch.tensor(cpu.tokenizer.encode(TEXT))
        ref = cpu.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(cpu), all_logits=True)[0]
        got = gpu.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(gpu), all_logits=True)[0].cpu()
        assert (got - ref).abs().max().item() <= 1e-3, f"{path}: one shot"
        kv, n = _kv(gpu), len(ids)
        for a, b in ((0, 13), (13, n - 2)):
            got = gpu.model.forward_chunks([SeqChunk(1, a, ids[a:b])], kv, all_logits=True)[0].cpu()
            assert (got - ref[a:b]).abs().max().item() <= 1e-3, f"{path}: chunk [{a},{b})"
        for pos in (n - 2, n - 1):
            got = gpu.model.forward_chunks([SeqChunk(1, pos, ids[pos : pos + 1])], kv)[0].cpu()
            assert (got - ref[pos]).abs().max().item() <= 1e-3, f"{path}: decode at {pos}"
    half = on_gpu(folder, torch.bfloat16, frozenset())
    ids = torch.tensor(half.tokenizer.encode(TEXT))
    ref = _load(folder).model.forward_chunks([SeqChunk(0, 0, ids)], _kv(_load(folder)), all_logits=True)[0]
    got = half.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(half), all_logits=True)[0].cpu()
    same = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert same >= 0.9, f"bfloat16 keeps the greedy token at only {same:.0%} of positions"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_it_computes_what_the_cpu_does(folder, gguf_path):
    check_on_gpu(folder, gguf_path)
