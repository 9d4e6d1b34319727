"""GLM-4.x MoE (transformers' Glm4MoeConfig, llama.cpp's `glm4moe`): its expert block against transformers' own
(sigmoid router with the score-correction bias, chosen among the best expert groups, an ungated shared expert),
and the whole model against transformers on tiny random weights."""

from __future__ import annotations

import pytest
import torch

from engine.model.moe import SparseMoe, route
from engine.model.moe_config import MoeConfig

transformers = pytest.importorskip("transformers")

HIDDEN = 32


def _glm_moe_block(n_experts: int = 8, n_group: int = 2, topk_group: int = 1, top_k: int = 2, seed: int = 0):
    """transformers' Glm4MoeMoE with random weights and a random score-correction bias."""
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE

    cfg = transformers.Glm4MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=16, n_routed_experts=n_experts,
                                     num_experts_per_tok=top_k, n_group=n_group, topk_group=topk_group,
                                     n_shared_experts=2, routed_scaling_factor=1.7, norm_topk_prob=True)
    torch.manual_seed(seed)
    block = Glm4MoeMoE(cfg).eval()
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.3)
        block.gate.e_score_correction_bias.normal_(0.0, 0.3)
    return cfg, block


def _moe_config(cfg) -> MoeConfig:
    return MoeConfig(n_experts=cfg.n_routed_experts, top_k=cfg.num_experts_per_tok, expert_size=cfg.moe_intermediate_size,
                     routing="sigmoid_bias", norm_topk_prob=cfg.norm_topk_prob,
                     shared_expert_size=cfg.moe_intermediate_size * cfg.n_shared_experts, shared_gated=False,
                     routed_scaling=cfg.routed_scaling_factor, norm_eps=1e-20, n_group=cfg.n_group,
                     topk_group=cfg.topk_group)


def test_grouped_sigmoid_routing_chooses_and_weighs_as_transformers():
    cfg, block = _glm_moe_block()
    h = torch.randn(64, HIDDEN)
    _, ref_weights, ref_experts = block.gate(h)
    logits = h @ block.gate.weight.T
    weights, experts = route(logits, _moe_config(cfg), block.gate.e_score_correction_bias)
    # transformers leaves the chosen k unsorted; the set and each expert's weight are what count
    ours = {(t, e): w for t in range(64) for e, w in zip(experts[t].tolist(), weights[t].tolist(), strict=True)}
    ref = {(t, e): w for t in range(64) for e, w in zip(ref_experts[t].tolist(), ref_weights[t].tolist(), strict=True)}
    assert ours.keys() == ref.keys()
    assert all(abs(ours[k] - ref[k]) <= 1e-6 for k in ref)
    # one group of two kept: every token's experts come from a single group of 4
    assert all(len({e // 4 for e in row}) == 1 for row in experts.tolist())
    # a file without the correction bias routes by the scores alone, by groups all the same
    _, unbiased = route(logits, _moe_config(cfg))
    assert all(len({e // 4 for e in row}) == 1 for row in unbiased.tolist())


def test_the_block_with_its_ungated_shared_expert_equals_transformers():
    cfg, block = _glm_moe_block()
    experts = block.experts
    moe = SparseMoe(_moe_config(cfg), HIDDEN, router=block.gate.weight.detach().clone(),
                    gate_up=experts.gate_up_proj.detach().clone(), down=experts.down_proj.detach().clone(),
                    shared_gate_up=torch.cat((block.shared_experts.gate_proj.weight, block.shared_experts.up_proj.weight)).detach(),
                    shared_down=block.shared_experts.down_proj.weight.detach().clone(),
                    expert_bias=block.gate.e_score_correction_bias.clone())
    h = torch.randn(40, HIDDEN)
    with torch.no_grad():
        ref = block(h[None])[0]
    got = moe(h, 0)
    assert (got - ref).abs().max().item() <= 1e-5
    one = moe(h[:1], 1)  # a decode row alone computes what it does among others
    assert (one - got[:1]).abs().max().item() <= 1e-5


@pytest.mark.parametrize(("change", "message"), [
    ({"n_group": 3}, r"n_group: expected a positive divisor of the 8 experts, got 3"),
    ({"n_group": 8}, r"each group needs at least 2 experts"),
    ({"topk_group": 3}, r"topk_group: expected 1 to n_group \(2\), got 3"),
    ({"top_k": 6}, r"num_experts_per_tok \(6\) exceeds the experts of the topk_group \(1\) groups kept \(4\)"),
    ({"routing": "softmax_topk"}, r"expert groups need sigmoid routing"),
])
def test_expert_groups_it_cannot_route_are_refused(change, message):
    fields = dict(n_experts=8, top_k=2, expert_size=16, routing="sigmoid_bias", norm_topk_prob=True, n_group=2,
                  topk_group=1)
    with pytest.raises(ValueError, match=message):
        MoeConfig(**{**fields, **change}).check(4)


def test_the_moe_families_from_before_groups_keep_their_identity():
    old = MoeConfig(n_experts=4, top_k=2, expert_size=8, routing="softmax_topk", norm_topk_prob=True,
                    shared_expert_size=16)
    assert not {"n_group", "topk_group", "shared_gated"} & old.describe().keys()


# ---------------------------------------------------------------- the whole model against transformers

ATOL = 1e-4  # float32 on both sides; only summation orders differ (tests/test_moe_models.py)
TEXT = "The quick brown fox jumps over the lazy dog. def add(a, b): return a + b  café 🙂 " * 2 + "Paris is"


def _load(path: str, **kwargs):
    from engine.model import load_model, plan_stages
    from engine.model.loader import read_model_config

    return load_model(path, plan_stages(read_model_config(path).n_layers, "cpu", ""), torch.float32, **kwargs)


def _kv(lm):
    from engine.kv import KVBuffers, KVLayout

    c = lm.config
    return KVBuffers(KVLayout(c.n_layers, c.n_kv_heads, c.head_dim, lm.dtype), 3, 256, lm.model.stages)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    from tests.moe_fixtures import write_tiny_moe_model

    return write_tiny_moe_model(tmp_path_factory.mktemp("glm4-moe"), "glm4_moe")


@pytest.fixture(scope="module")
def lm(folder):
    return _load(folder)


@pytest.fixture(scope="module")
def reference(folder, lm):
    """(ids, transformers' logits) for TEXT."""
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()  # it reports the MTP layer's tensors as unexpected
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor(lm.tokenizer.encode(TEXT))
    with torch.no_grad():
        return ids, model(ids[None]).logits[0]


def test_the_config_is_read_as_glm_describes_its_layers(lm):
    from engine.model import executors

    c = lm.config
    assert (c.architecture, c.rotary_dim, c.head_dim, c.qk_norm, c.attention_bias, c.mtp_layers) == (
        "glm4_moe", 8, 16, True, True, 1)
    m = c.moe
    assert (m.n_group, m.topk_group, m.shared_expert_size, m.shared_gated, m.routed_scaling, m.dense_layers) == (
        2, 1, 32, False, 2.5, (0,))
    assert [layer.moe is not None for layer in lm.model.layers] == [False, True, True, True]
    assert lm.model.layers[1].moe.expert_bias.abs().sum() > 0  # the fixture's random correction bias
    features = lm.model.description.features()
    assert {"partial or no rope", "sigmoid routing", "ungated shared expert", "attention bias"} <= features
    assert executors.layer_declines(executors.EAGER, lm.model.description) is None
    assert executors.cpu_step_declines(lm.model) == "partial RoPE"
    # The native step runs every GLM layer feature (tests/test_native_experts.py runs it on this model's 4-bit
    # form); this float model's projections are what it declines.
    assert executors.layer_declines(executors.NATIVE_STEP, lm.model.description) is None
    assert executors.native_step_declines(lm.model) == "projections not in the native 4-bit blocks"


def test_logits_match_transformers_one_shot_chunked_and_decoding(lm, reference):
    from engine.model import SeqChunk

    ids, ref = reference
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


def test_the_next_token_layer_is_kept_as_the_checkpoint_holds_it(lm):
    (layer,) = lm.model.mtp
    assert {"nextn.eh_proj", "nextn.enorm", "nextn.hnorm", "nextn.shared_head_norm", "q", "q_bias", "router",
            "expert_bias", "shared.gate", "expert.7.down", "mlp_norm"} <= layer.keys()
    eh = layer["nextn.eh_proj"]
    assert (eh.name, eh.shape, eh.kind) == ("model.layers.4.eh_proj.weight", (64, 128), "torch.float32")
    assert len(lm.model.layers) == 4  # kept, not run


def test_without_q_k_norms_it_still_matches_transformers(tmp_path):
    from engine.model import SeqChunk
    from tests.moe_fixtures import write_tiny_moe_model

    path = write_tiny_moe_model(tmp_path, "glm4_moe", use_qk_norm=False, attention_bias=False, seed=1)
    lm = _load(path)
    assert not lm.config.qk_norm and not lm.config.attention_bias
    transformers.utils.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor(lm.tokenizer.encode(TEXT))
    with torch.no_grad():
        ref = model(ids[None]).logits[0]
    ours = lm.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(lm), all_logits=True)[0]
    assert (ours - ref).abs().max().item() <= ATOL


@pytest.mark.parametrize(("change", "message"), [
    ({"first_k_dense_replace": 9}, r"first_k_dense_replace: expected 0 to 4 \(the layers\), got 9"),
    ({"n_group": 3}, r"n_group: expected a positive divisor of the 8 experts, got 3"),
    ({"topk_group": 5}, r"topk_group: expected 1 to n_group \(2\), got 5"),
    ({"partial_rotary_factor": 1.5, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}},
     r"partial_rotary_factor: expected a number in \(0, 1\], got 1.5"),
    ({"n_shared_experts": -1}, r"n_shared_experts: expected a whole number >= 0, got -1"),
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


# ---------------------------------------------------------------- the GGUF llama.cpp's converter writes

@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory) -> str:
    from tests.moe_fixtures import write_tiny_moe_gguf

    return write_tiny_moe_gguf(tmp_path_factory.mktemp("glm4-moe-gguf"), "glm4_moe")


def test_its_gguf_loads_to_the_same_logits_and_keeps_the_next_token_layer_as_stored(gguf_path, caplog):
    import logging

    from engine.model import SeqChunk

    folder_lm = _load(gguf_path.removesuffix(".gguf"))
    with caplog.at_level(logging.INFO, logger="strata.engine"):
        file_lm = _load(gguf_path)
    assert "kept 1 next-token (MTP) layer(s)" in caplog.text
    assert file_lm.config.rotary_dim == 8 and file_lm.config.mtp_layers == 1 and file_lm.config.n_layers == 4
    assert file_lm.config.moe == folder_lm.config.moe
    ids = torch.tensor(folder_lm.tokenizer.encode(TEXT))
    a, b = (x.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(x), all_logits=True)[0] for x in (folder_lm, file_lm))
    assert (a - b).abs().max().item() <= ATOL
    (layer,) = file_lm.model.mtp
    eh = layer["nextn.eh_proj"]
    assert (eh.name, eh.kind, eh.shape, eh.data.dtype) == ("blk.4.nextn.eh_proj.weight", "F32", (64, 128), torch.uint8)
    assert torch.equal(eh.data.view(torch.float32).view(64, 128), folder_lm.model.mtp[0]["nextn.eh_proj"].data)
    assert {"experts.gate", "experts.down", "shared.up", "expert_bias", "mlp_norm", "nextn.hnorm"} <= layer.keys()


def test_a_gguf_with_softmax_gating_is_refused(gguf_path, tmp_path):
    import shutil

    import gguf

    from engine.errors import ModelLoadError
    from engine.model.loader import read_model_config

    path = str(tmp_path / "softmax.gguf")
    shutil.copy(gguf_path, path)
    reader = gguf.GGUFReader(path, "r+")
    field = reader.fields["glm4moe.expert_gating_func"]
    field.parts[field.data[0]][0] = 1  # softmax, written in place
    del reader
    with pytest.raises(ModelLoadError, match=r"expert_gating_func 1: expected 2 \(sigmoid\) for glm4moe"):
        read_model_config(path)


# ---------------------------------------------------------------- experts in host RAM, a parked conversation

def test_experts_in_host_ram_and_a_parked_conversation_resumes_exactly(folder):
    """`--moe-experts cpu`: every expert layer's routed experts in host RAM as 4-bit groups (the shared expert
    stays as it is, where the layer runs); a conversation parked on disk and restored continues as one that
    never left, and one parked in tiered storage does across an engine restart."""
    from engine.model import int4, moe_placement
    from engine.model.loader import read_model_config
    from tools.conversation_cache_parity import run_restart, run_scenario

    if not int4.available():
        pytest.skip("this torch has no CPU int4 kernels")
    layers = moe_placement.cpu_expert_layers(read_model_config(folder), "cpu", 0)
    assert layers == {1, 2, 3}  # layer 0 is dense (first_k_dense_replace)
    lm = _load(folder, cpu_experts=layers)
    moe = lm.model.layers[1].moe
    assert all(isinstance(w, int4.Int4Weight) for w in moe.gate_up) and isinstance(moe.shared_gate_up, torch.Tensor)
    assert moe.expert_device.type == "cpu"
    base = {"model": folder, "devices": "cpu", "ctx_size": 512, "cpu_weights": "float", "moe_experts": "cpu",
            "conversation_cache_storage": "disk", "conversation_cache_min_free_mib": 0, "prefill_chunk": 32}
    outcome = run_scenario("basic", base, n_words=40, max_tokens=8)
    assert outcome.passed, outcome.detail
    # tiered, across a restart: the conversation parked by one engine resumes exactly in the next
    outcome = run_restart({**base, "conversation_cache_storage": "tiered"}, {}, n_words=40, max_tokens=8)
    assert outcome.passed, outcome.detail


def test_a_glm_gguf_tokenizer_splits_text_as_llama_cpp_does():
    """llama.cpp's `glm4` pre-tokenizer (CHATGLM4) splits digits in threes and contractions case-blind, as
    Llama 3's does; without it the GPT-2 split would keep "12345" whole."""
    from engine.model.tokenizer import Tokenizer

    tokens = [chr(c) for c in range(33, 127)] + ["Ġ"]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "glm4", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.merges": [], "tokenizer.ggml.token_type": [1] * len(tokens)}
    backend = Tokenizer.from_gguf_metadata(meta).backend
    pieces = [p for p, _ in backend.pre_tokenizer.pre_tokenize_str("n 12345 IT'S")]
    assert pieces == ["n", "Ġ", "123", "45", "ĠIT", "'S"]


def test_int4_weights_track_float(tmp_path):
    """`--cpu-weights int4` (every projection, the routed and the shared experts as 4-bit groups; the router and
    its bias in float) on weights that lie on a 4-bit grid: the greedy token mostly stays (bfloat16 activations
    change a few near-ties of a random model)."""
    from engine.model import SeqChunk, int4
    from tests.moe_fixtures import write_tiny_moe_model

    if not int4.available():
        pytest.skip("this torch has no CPU int4 kernels")
    path = write_tiny_moe_model(tmp_path, "glm4_moe", int4_grid=True)
    ref_lm, lm = _load(path), _load(path, int4_weights=True)
    moe = lm.model.layers[1].moe
    assert isinstance(moe.gate_up[0], int4.Int4Weight) and isinstance(moe.shared_gate_up, int4.Int4Weight)
    assert moe.router.dtype == torch.float32 and moe.expert_bias.dtype == torch.float32
    ids = torch.tensor(lm.tokenizer.encode(TEXT))
    ref, got = (x.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(x), all_logits=True)[0] for x in (ref_lm, lm))
    same = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert same >= 0.8, f"int4 weights keep the greedy token at only {same:.0%} of positions"


def test_glm_4_5_air_config_json_is_read_as_released():
    """GLM-4.5-Air's own config.json (transformers 4.x style: partial_rotary_factor and rope_theta at the top
    level); a dense family's description gains none of GLM's fields."""
    from engine.model.config import ModelConfig

    air = {"architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "first_k_dense_replace": 1,
           "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 10944,
           "max_position_embeddings": 131072, "model_type": "glm4_moe", "moe_intermediate_size": 1408,
           "n_group": 1, "n_routed_experts": 128, "n_shared_experts": 1, "norm_topk_prob": True,
           "num_attention_heads": 96, "num_experts_per_tok": 8, "num_hidden_layers": 46, "num_key_value_heads": 8,
           "num_nextn_predict_layers": 1, "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-05,
           "rope_scaling": None, "rope_theta": 1000000, "routed_scaling_factor": 1.0, "tie_word_embeddings": False,
           "topk_group": 1, "use_qk_norm": False, "vocab_size": 151552}
    c = ModelConfig.from_hf(air)
    assert (c.rotary_dim, c.head_dim, c.rope_theta, c.rope_scaling, c.mtp_layers, c.qk_norm) == (
        64, 128, 1e6, None, 1, False)
    assert (c.moe.n_experts, c.moe.top_k, c.moe.shared_expert_size, c.moe.n_group, c.moe.dense_layers) == (
        128, 8, 1408, 1, (0,))
    described = c.describe()
    assert described["rotary_dim"] == 64 and "n_group" not in described["moe"]  # 1: left out, as for others
    llama = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
                                 "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100,
                                 "partial_rotary_factor": 0.5})
    assert llama.rotary_dim is None and not {"rotary_dim", "mtp_layers"} & llama.describe().keys()


def test_a_gguf_of_the_next_token_layer_alone_is_refused(gguf_path):
    from engine.errors import ModelLoadError
    from engine.model.gguf_header import read_gguf_header
    from engine.model.gguf_loading import gguf_config

    header = read_gguf_header(gguf_path)
    names = {t.name for t in header.tensors}
    assert gguf_config(header.metadata, names, gguf_path).n_layers == 4
    mtp_only = {n for n in names if not n.startswith(("blk.0.", "blk.1.", "blk.2.", "blk.3."))}
    with pytest.raises(ModelLoadError, match=r"holds only the next-token \(MTP\) layer"):
        gguf_config(header.metadata, mtp_only, gguf_path)
