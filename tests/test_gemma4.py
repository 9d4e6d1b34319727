"""Gemma 4 (text) against transformers (float32, CPU) on a tiny random-weight model: per-layer input
embeddings, weightless value norms, layer scalars, a global layer with its own head shape (wider heads, more K/V
heads) whose values are its keys' projection, proportional RoPE and a window of 8, over prompts several windows long: one shot, chunked prefill, decode,
batched slots; and the variants refused at load."""

from __future__ import annotations

import json
import os

import pytest
import torch

from engine.errors import ModelLoadError
from engine.kv import KVBuffers, KVLayout
from engine.model import SeqChunk, executors, load_model, plan_stages
from engine.model.config import ConfigError, ModelConfig
from engine.model.gemma4 import gguf_gemma4_fields
from engine.model.loader import read_model_config
from tests.model_fixtures import write_tiny_gguf, write_tiny_model

transformers = pytest.importorskip("transformers")
transformers.utils.logging.disable_progress_bar()

ATOL = 1e-4
TEXT = "The quick brown fox jumps over the lazy dog. def add(a, b): return a + b  café 🙂 " * 2


def _load(path: str):
    return load_model(path, plan_stages(read_model_config(path).n_layers, "cpu", ""), torch.float32)


def _kv(lm, n_slots: int = 3, ctx: int = 256) -> KVBuffers:
    c = lm.config
    return KVBuffers(KVLayout(c.kv_layers, *c.kv_row, lm.dtype), n_slots, ctx,
                     [(d, a, min(b, c.kv_layers)) for d, a, b in lm.model.stages if a < c.kv_layers])


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return write_tiny_model(tmp_path_factory.mktemp("gemma4"), "gemma4")


@pytest.fixture(scope="module")
def lm(model):
    return _load(model)


# Two layers reading earlier layers' K/V (a sliding one layer 3's, the global one layer 2's), their MLP doubled.
SHARED = {"num_kv_shared_layers": 2, "use_double_wide_mlp": True,
          "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2}


@pytest.fixture(scope="module")
def shared_model(tmp_path_factory) -> str:
    return write_tiny_model(tmp_path_factory.mktemp("gemma4-shared"), "gemma4", name="tiny-gemma4-shared", **SHARED)


@pytest.fixture(scope="module")
def reference(model, lm) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor(lm.tokenizer.encode(TEXT))
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        return ids, hf(ids[None]).logits[0]


def test_config_and_layer_description(lm):
    c = lm.config
    assert (c.architecture, c.sliding_window, c.sliding_layers) == ("gemma4", 8, (0, 1, 2, 3, 4))
    assert (c.per_layer_input, c.attention_k_eq_v, c.rope_pairs, c.query_pre_attn_scalar) == (8, True, 4, 1.0)
    # Sliding layers: 2 K/V heads of 16; the global one: 4 of 32. A slot's row holds the wider: 4 x 32.
    assert (c.layer_heads(0), c.layer_heads(5), c.kv_row) == ((2, 16), (4, 32), (4, 32))
    used = lm.model.description.features()
    assert {"value norm", "layer scale", "per-layer inputs", "post-norms", "local rope"} <= used
    # Only the eager forward runs Gemma 4's layer; the others say why.
    assert executors.cpu_step_declines(lm.model) == "Gemma 4 layers"
    assert executors.native_step_declines(lm.model) == "Gemma 4 layers"


def test_one_shot_logits_match_transformers(lm, reference):
    ids, ref = reference
    assert len(ids) > 8 * lm.config.sliding_window
    got = lm.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(lm), all_logits=True)[0]
    assert _diff(got, ref) <= ATOL, f"max |logit diff| {_diff(got, ref):.3g}"


@pytest.mark.parametrize("chunk", [5, 40])
def test_chunked_prefill_then_decode_match_transformers(lm, reference, chunk):
    ids, ref = reference
    kv = _kv(lm)
    n = len(ids) - 4
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        got = lm.model.forward_chunks([SeqChunk(1, a, ids[a:b])], kv, all_logits=True)[0]
        assert _diff(got, ref[a:b]) <= ATOL, f"chunk [{a},{b}) differs by {_diff(got, ref[a:b]):.3g}"
    for pos in range(n, len(ids)):
        got = lm.model.forward_chunks([SeqChunk(1, pos, ids[pos : pos + 1])], kv)[0]
        assert _diff(got, ref[pos]) <= ATOL, f"decode at {pos} differs by {_diff(got, ref[pos]):.3g}"


def test_batched_slots_each_match_transformers(lm, reference):
    ids, ref = reference
    kv = _kv(lm)
    n = len(ids)
    lm.model.forward_chunks([SeqChunk(0, 0, ids[:30]), SeqChunk(2, 0, ids[:50])], kv)
    got = lm.model.forward_chunks(
        [SeqChunk(0, 30, ids[30 : n - 1]), SeqChunk(2, 50, ids[50:51]), SeqChunk(1, 0, ids[:20])], kv, all_logits=True
    )
    assert _diff(got[0], ref[30 : n - 1]) <= ATOL
    assert _diff(got[1], ref[50:51]) <= ATOL
    assert _diff(got[2], ref[:20]) <= ATOL


def _hf(**overrides) -> dict:
    cfg = {"architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "vocab_size": 300,
           "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 16, "sliding_window": 8,
           "hidden_size_per_layer_input": 8}
    cfg.update(overrides)
    return cfg


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_kv_shared_layers": 2, "layer_types": ["sliding_attention"] * 5 + ["full_attention"]},
         "num_kv_shared_layers"),
        ({"global_head_dim": 15}, "even width"),
        ({"attention_k_eq_v": True, "num_global_key_value_heads": 3}, "divisor"),
        ({"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2}, "moe_intermediate_size"),
        ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
        ({"hidden_activation": "relu"}, "hidden_activation"),
    ],
)
def test_variants_out_of_reach_are_refused_with_the_setting_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf(_hf(**overrides))


def test_global_head_shape_is_resolved_as_transformers_resolves_it():
    """global_head_dim when given; else a saved per_layer_config's entry for a global layer (an empty one: the
    sliding layers' shape); else Gemma4TextConfig's 512. K/V heads of their own only with attention_k_eq_v."""
    cfg = _hf()
    del cfg["global_head_dim"]
    assert ModelConfig.from_hf(cfg).layer_heads(5) == (2, 512)
    assert ModelConfig.from_hf({**cfg, "per_layer_config": {}}).layer_heads(5) == (2, 16)
    saved = {"5": {"head_dim": 32, "num_key_value_heads": 1}}
    assert ModelConfig.from_hf({**cfg, "per_layer_config": saved, "attention_k_eq_v": True}).layer_heads(5) == (1, 32)
    assert ModelConfig.from_hf({**cfg, "global_head_dim": 64, "num_global_key_value_heads": 1}).layer_heads(5) == (2, 64)


def test_layers_sharing_earlier_k_v_match_transformers_and_hold_no_k_v(shared_model, tmp_path):
    """K/V-sharing layers: the slots hold the first four layers only; one shot, chunks and decode match
    transformers; the GGUF of the same weights (no attn_k/attn_v on those layers, per-layer MLP widths) too."""
    lm = _load(shared_model)
    c = lm.config
    assert (c.kv_layers, c.kv_source(4), c.kv_source(5), c.mlp_size(3), c.mlp_size(4)) == (4, 3, 2, 128, 256)
    assert "shared K/V" in lm.model.description.features()
    ids = torch.tensor(lm.tokenizer.encode(TEXT))
    hf = transformers.AutoModelForCausalLM.from_pretrained(shared_model, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    kv = _kv(lm)
    assert kv.layout.n_layers == 4
    got = lm.model.forward_chunks([SeqChunk(0, 0, ids)], kv, all_logits=True)[0]
    assert _diff(got, ref) <= ATOL, f"one shot: {_diff(got, ref):.3g}"
    n = len(ids) - 3
    for a in range(0, n, 13):
        b = min(a + 13, n)
        part = lm.model.forward_chunks([SeqChunk(1, a, ids[a:b])], kv, all_logits=True)[0]
        assert _diff(part, ref[a:b]) <= ATOL, f"chunk [{a},{b}): {_diff(part, ref[a:b]):.3g}"
    for pos in range(n, len(ids)):
        one = lm.model.forward_chunks([SeqChunk(1, pos, ids[pos : pos + 1])], kv)[0]
        assert _diff(one, ref[pos]) <= ATOL, f"decode at {pos}: {_diff(one, ref[pos]):.3g}"
    gguf = _load(write_tiny_gguf(tmp_path, "gemma4", quantize=False, **SHARED))
    assert (gguf.config.kv_layers, gguf.config.double_wide_mlp) == (4, True)
    from_file = gguf.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(gguf), all_logits=True)[0]
    assert _diff(from_file, ref) <= ATOL


def test_expert_block_beside_the_mlp_matches_transformers(tmp_path):
    """enable_moe_block: every layer's experts (4, top 2, GeGLU) beside its dense MLP, routed from the residual;
    the GGUF of the same weights (llama.cpp's names: ffn_gate_inp with its .scale, ffn_gate_up_exps, ...) too."""
    experts = {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32}
    gguf_path = write_tiny_gguf(tmp_path, "gemma4", quantize=False, **experts)
    path = os.path.join(tmp_path, "tiny-gemma4")
    lm = _load(path)
    assert lm.config.parallel_experts == (4, 2, 32) and "parallel experts" in lm.model.description.features()
    ids = torch.tensor(lm.tokenizer.encode(TEXT))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    kv = _kv(lm)
    got = lm.model.forward_chunks([SeqChunk(0, 0, ids)], kv, all_logits=True)[0]
    assert _diff(got, ref) <= ATOL, f"one shot: {_diff(got, ref):.3g}"
    n = len(ids) - 2
    lm.model.forward_chunks([SeqChunk(1, 0, ids[:n])], kv)
    for pos in range(n, len(ids)):
        one = lm.model.forward_chunks([SeqChunk(1, pos, ids[pos : pos + 1])], kv)[0]
        assert _diff(one, ref[pos]) <= ATOL, f"decode at {pos}: {_diff(one, ref[pos]):.3g}"
    gguf = _load(gguf_path)
    assert gguf.config.parallel_experts == (4, 2, 32)
    from_file = gguf.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(gguf), all_logits=True)[0]
    assert _diff(from_file, ref) <= ATOL


def test_a_refused_folder_fails_to_load_with_the_reason(model, tmp_path):
    out = tmp_path / "shared"
    out.mkdir()
    for name in os.listdir(model):
        os.symlink(os.path.join(model, name), out / name)
    with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    os.unlink(out / "config.json")
    (out / "config.json").write_text(json.dumps({**cfg, "use_bidirectional_attention": "all"}), encoding="utf-8")
    with pytest.raises(ModelLoadError, match="use_bidirectional_attention"):
        _load(str(out))


def test_gguf_as_llama_cpp_converts_it_loads_the_model_of_its_folder(tmp_path):
    """A gemma4 GGUF written as llama.cpp's converter writes it (its names, norms as w, no attn_v on the global
    layer, rope_freqs with 1e30 for the unrotated frequencies, the per-layer tensors) gives the folder's logits."""
    path = write_tiny_gguf(tmp_path, "gemma4", quantize=False)
    from_gguf, from_folder = _load(path), _load(os.path.join(tmp_path, "tiny-gemma4"))
    assert from_gguf.config.attention_k_eq_v and from_gguf.config.per_layer_input == 8
    ids = torch.tensor(from_folder.tokenizer.encode(TEXT))
    assert from_gguf.tokenizer.encode(TEXT) == ids.tolist()
    a = from_gguf.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(from_gguf), all_logits=True)[0]
    b = from_folder.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(from_folder), all_logits=True)[0]
    assert _diff(a, b) <= ATOL


@pytest.mark.parametrize(
    ("meta", "message"),
    [
        ({"gemma4.attention.head_count_kv": [2, 1, 2, 2, 2, 1],
          "gemma4.attention.sliding_window_pattern": [True] * 5 + [False]}, "head_count_kv"),
        ({"gemma4.feed_forward_length": [128] * 4 + [256] * 2}, "feed_forward_length"),
        ({"gemma4.attention.key_length": 32, "gemma4.attention.value_length": 16}, "key and value widths"),
    ],
)
def test_gguf_variants_out_of_reach_are_refused_with_the_key_named(meta, message):
    with pytest.raises(ValueError, match=message):
        gguf_gemma4_fields("gemma4", meta, set(), 6, 300)


def test_call_markers_special_in_tokenizer_json_decode_as_text(tmp_path):
    """Gemma 4's tokenizer.json makes its call and string markers special tokens; decoded answers keep them (as
    llama.cpp's converter keeps them), so the tool-call parser sees the call."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as FastTokenizer

    from engine.model.tokenizer import Tokenizer
    from tests.model_fixtures import write_tokenizer_files

    write_tokenizer_files(tmp_path)
    fast = FastTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    fast.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<|tool_call>", '<|"|>')])
    fast.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_hf_folder(str(tmp_path))
    ids = tok.encode('<|tool_call>call:f{a:<|"|>x<|"|>}')
    assert tok.decode(ids) == '<|tool_call>call:f{a:<|"|>x<|"|>}'


def test_gguf_gemma4_tokenizer_model_reads_as_sentencepiece_style_bpe():
    """tokenizer.ggml.model "gemma4" (llama.cpp's converter): merges over U+2581 spaces, no dummy prefix, BOS added,
    the call marker a user-defined token that decodes as text, <turn|> an end of turn."""
    from engine.model.tokenizer import Tokenizer

    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<turn|>", "<|tool_call>", "\u2581", "a", "b", "c", "\u2581a", "ab",
              "\u2581ab"] + [f"<0x{i:02X}>" for i in range(256)]
    meta = {"tokenizer.ggml.model": "gemma4", "tokenizer.ggml.pre": "gemma4", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3, 3, 3, 2, 3, 4] + [1] * (len(tokens) - 6),
            "tokenizer.ggml.merges": ["\u2581 a", "a b", "\u2581a b"], "tokenizer.ggml.bos_token_id": 2,
            "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.add_bos_token": True,
            "tokenizer.ggml.add_space_prefix": False}
    tok = Tokenizer.from_gguf_metadata(meta)
    ids = tok.encode("ab ab<|tool_call>c", add_special_tokens=True)
    assert [tokens[i] for i in ids] == ["<bos>", "ab", "\u2581ab", "<|tool_call>", "c"]
    assert tok.decode(ids) == "ab ab<|tool_call>c" and {1, 4} <= set(tok.eos_token_ids)


def test_the_stage_planner_counts_the_wider_global_layer_the_row_and_the_expert_block():
    from engine.model.planning import layer_bytes

    types = {"layer_types": ["sliding_attention"] * 5 + ["full_attention"]}
    plain = ModelConfig.from_hf(_hf(**types, global_head_dim=16))
    wide = ModelConfig.from_hf(_hf(**types, global_head_dim=64))
    experts = ModelConfig.from_hf(_hf(**types, global_head_dim=64, enable_moe_block=True, num_experts=4,
                                      top_k_experts=2, moe_intermediate_size=32))
    per_token = 2 * 4  # K and V, float32
    assert layer_bytes(plain, torch.float32, 1, 1) == layer_bytes(plain, torch.float32, 1, 0) + per_token * 2 * 16
    assert layer_bytes(wide, torch.float32, 1, 1) == layer_bytes(wide, torch.float32, 1, 0) + per_token * 2 * 64
    # The global layer: q and o (4 heads), k and v (2 heads) 48 channels wider each, by hidden 64, float32.
    assert layer_bytes(wide, torch.float32, 1, 0) - layer_bytes(plain, torch.float32, 1, 0) == 4 * 64 * (
        2 * 4 * 48 + 2 * 2 * 48)
    assert layer_bytes(experts, torch.float32, 1, 0) - layer_bytes(wide, torch.float32, 1, 0) == 4 * 4 * (
        3 * 64 * 32 + 64)
