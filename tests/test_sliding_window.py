"""Sliding-window attention and Gemma 3 against transformers (float32, CPU) on tiny random-weight models, with
prompts several windows long: one shot, chunked prefill of several chunk sizes, decode, and batched."""

from __future__ import annotations

import json
import os

import pytest
import torch

from engine.kv import KVBuffers, KVLayout
from engine.model import SeqChunk, load_model, plan_stages
from engine.model.config import ConfigError, ModelConfig
from engine.model.loader import read_model_config
from tests.model_fixtures import SLIDING, write_tiny_gguf, write_tiny_model

transformers = pytest.importorskip("transformers")
transformers.utils.logging.disable_progress_bar()

ATOL = 1e-4
TEXT = "The quick brown fox jumps over the lazy dog. def add(a, b): return a + b  café 🙂 " * 2


def _load(path: str):
    return load_model(path, plan_stages(read_model_config(path).n_layers, "cpu", ""), torch.float32)


def _kv(lm, n_slots: int = 3, ctx: int = 256) -> KVBuffers:
    c = lm.config
    return KVBuffers(KVLayout(c.n_layers, c.n_kv_heads, c.head_dim, lm.dtype), n_slots, ctx, lm.model.stages)


def _reference(path: str, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids[None]).logits[0]


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("sliding")
    return {arch: write_tiny_model(root, arch, **overrides) for arch, overrides in SLIDING.items()}


@pytest.fixture(scope="module")
def references(models) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    out = {}
    for arch, path in models.items():
        ids = torch.tensor(_load(path).tokenizer.encode(TEXT))
        out[arch] = (ids, _reference(path, ids))
    return out


@pytest.mark.parametrize("arch", list(SLIDING))
def test_one_shot_logits_match_transformers_past_the_window(models, references, arch, tmp_path):
    ids, ref = references[arch]
    lm = _load(models[arch])
    assert lm.config.sliding_window == 8 and len(ids) > 8 * lm.config.sliding_window
    got = lm.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(lm), all_logits=True)[0]
    assert _diff(got, ref) <= ATOL, f"{arch}: max |logit diff| {_diff(got, ref):.3g}"
    # The window matters: the same weights with a window longer than the prompt give other logits past it.
    full = _load(_without_window(models[arch], tmp_path))
    other = full.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(full), all_logits=True)[0]
    assert _diff(other[:8], ref[:8]) <= ATOL and _diff(other, ref) > 100 * ATOL


def _without_window(folder: str, tmp_path) -> str:
    out = tmp_path / "full"
    out.mkdir()
    for name in os.listdir(folder):
        os.symlink(os.path.join(folder, name), out / name)
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["sliding_window"] = 4096
    os.unlink(out / "config.json")
    (out / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    return str(out)


@pytest.mark.parametrize("arch", list(SLIDING))
@pytest.mark.parametrize("chunk", [3, 8, 13, 40])
def test_chunked_prefill_then_decode_match_transformers(models, references, arch, chunk):
    ids, ref = references[arch]
    lm = _load(models[arch])
    kv = _kv(lm)
    n = len(ids) - 4
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        got = lm.model.forward_chunks([SeqChunk(1, a, ids[a:b])], kv, all_logits=True)[0]
        assert _diff(got, ref[a:b]) <= ATOL, f"{arch}: chunk [{a},{b}) differs by {_diff(got, ref[a:b]):.3g}"
    for pos in range(n, len(ids)):
        got = lm.model.forward_chunks([SeqChunk(1, pos, ids[pos : pos + 1])], kv)[0]
        assert _diff(got, ref[pos]) <= ATOL, f"{arch}: decode at {pos} differs by {_diff(got, ref[pos]):.3g}"


@pytest.mark.parametrize("arch", list(SLIDING))
def test_batched_slots_each_match_transformers(models, references, arch):
    """Prefill chunks and decodes of different slots in one call, each slot past the window."""
    ids, ref = references[arch]
    lm = _load(models[arch])
    kv = _kv(lm)
    n = len(ids)
    lm.model.forward_chunks([SeqChunk(0, 0, ids[:30]), SeqChunk(2, 0, ids[:50])], kv)
    got = lm.model.forward_chunks(
        [SeqChunk(0, 30, ids[30:n - 1]), SeqChunk(2, 50, ids[50:51]), SeqChunk(1, 0, ids[:20])], kv, all_logits=True
    )
    assert _diff(got[0], ref[30 : n - 1]) <= ATOL
    assert _diff(got[1], ref[50:51]) <= ATOL
    assert _diff(got[2], ref[:20]) <= ATOL
    last = lm.model.forward_chunks([SeqChunk(2, 51, ids[51:52]), SeqChunk(0, n - 1, ids[n - 1 :])], kv)
    assert _diff(last[0], ref[51]) <= ATOL and _diff(last[1], ref[n - 1]) <= ATOL


def test_gemma3_gguf_loads_the_model_of_its_folder(tmp_path):
    """A gemma3 GGUF written like llama.cpp's converter (its tensor names, norms stored as 1 + w, the window
    key; the query scale implied by the head width) gives the logits of the HF folder it came from."""
    path = write_tiny_gguf(tmp_path, "gemma3", quantize=False, query_pre_attn_scalar=16, **SLIDING["gemma3"])
    from_gguf, from_folder = _load(path), _load(os.path.join(tmp_path, "tiny-gemma3"))
    assert from_gguf.config.sliding_layers == from_folder.config.sliding_layers == (0, 1, 2, 3, 4)
    assert from_gguf.config.rope_local_theta == from_folder.config.rope_local_theta == 10000.0
    ids = from_folder.tokenizer.encode(TEXT)
    assert from_gguf.tokenizer.encode(TEXT) == ids
    a = from_gguf.model.forward_chunks([SeqChunk(0, 0, torch.tensor(ids))], _kv(from_gguf), all_logits=True)[0]
    b = from_folder.model.forward_chunks([SeqChunk(0, 0, torch.tensor(ids))], _kv(from_folder), all_logits=True)[0]
    assert _diff(a, b) <= ATOL


def _hf(arch: str, **cfg) -> ModelConfig:
    base = {"architectures": [arch], "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 4,
            "intermediate_size": 128, "vocab_size": 100}
    return ModelConfig.from_hf(base | cfg)


def test_windows_are_read_as_transformers_applies_them():
    assert _hf("MistralForCausalLM", sliding_window=None).sliding_window is None
    assert _hf("MistralForCausalLM").sliding_layers == (0, 1, 2, 3)  # MistralConfig's default window of 4096
    assert _hf("Qwen2ForCausalLM", sliding_window=64).sliding_window is None  # use_sliding_window off
    qwen = _hf("Qwen2ForCausalLM", use_sliding_window=True, sliding_window=64, max_window_layers=2)
    assert (qwen.sliding_window, qwen.sliding_layers) == (64, (2, 3))
    typed = _hf("Qwen3ForCausalLM", use_sliding_window=True, sliding_window=64,
                layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])
    assert typed.sliding_layers == (0, 2)
    assert _hf("Gemma3ForCausalLM", sliding_window=16, sliding_window_pattern=2).sliding_layers == (0, 2)
    assert _hf("LlamaForCausalLM").sliding_window is None
    # A dense model without a window describes itself as before (the identity of its parked K/V).
    assert not {"sliding_window", "sliding_layers", "rope_local_theta"} & set(_hf("LlamaForCausalLM").describe())


@pytest.mark.parametrize(
    ("arch", "cfg", "message"),
    [
        ("Gemma3ForCausalLM", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ("Gemma3ForCausalLM", {"hidden_activation": "relu"}, "hidden_activation"),
        ("Qwen2ForCausalLM", {"use_sliding_window": True, "layer_types": ["full_attention"]}, "layer_types"),
        ("MixtralForCausalLM", {"sliding_window": 4096, "num_local_experts": 4, "num_experts_per_tok": 2},
         "sliding-window attention is not supported"),
    ],
)
def test_unsupported_window_and_gemma_settings_are_refused(arch, cfg, message):
    with pytest.raises(ConfigError, match=message):
        _hf(arch, **cfg)
