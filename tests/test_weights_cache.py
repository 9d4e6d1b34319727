"""The converted 4-bit CPU weights kept between starts (--weights-cache, engine/model/weights_cache.py): a second
load reads them instead of converting, computes bit for bit the same, and a damaged, foreign or stale cache file
is refused before it is used."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from engine.model import SeqChunk, gguf_dequant, int4, load_model, plan_stages
from engine.model.loader import read_model_config
from engine.model.weights_cache import KEEP
from tests.engine_process import start_engine
from tests.int4_kernels import same
from tests.model_fixtures import write_tiny_gguf


def _load(path: str, cache: str | None):
    stages = plan_stages(read_model_config(path).n_layers, "cpu", "")
    return load_model(path, stages, torch.float32, int4_weights=True, weights_cache_dir=cache)


def _logits(loaded) -> torch.Tensor:
    from engine.kv import KVBuffers, KVLayout

    c = loaded.config
    kv = KVBuffers(KVLayout(c.n_layers, c.n_kv_heads, c.head_dim, loaded.dtype), 1, 64, loaded.model.stages)
    ids = torch.tensor(loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog."))
    with torch.inference_mode():
        return loaded.model.forward_chunks([SeqChunk(0, 0, ids)], kv, all_logits=True)[0]


def _weights(loaded) -> list[int4.Int4Weight]:
    layers = [getattr(layer, n) for layer in loaded.model.layers for n in ("wqkv", "wo", "w_gate_up", "w_down")]
    return [*layers, loaded.model.lm_head]


def _cache_files(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.endswith(".int4.safetensors"))


@pytest.fixture(scope="module")
def q4_model(tmp_path_factory) -> str:
    return write_tiny_gguf(tmp_path_factory.mktemp("q4"), "llama", qtype="Q4_1", hidden_size=256,
                           intermediate_size=512, head_dim=64)


def test_second_load_reads_the_packed_weights_and_computes_the_same(q4_model, tmp_path, monkeypatch, kernel):
    cache = str(tmp_path / "weights")
    first = _load(q4_model, cache)
    assert len(_cache_files(cache)) == 1
    # A hit converts nothing: the Q4 conversion and the packing kernel would fail if they were called.
    monkeypatch.setattr(gguf_dequant, "q4_groups", lambda *a, **k: pytest.fail("converted a cached weight"))
    monkeypatch.setattr(int4.Int4Weight, "_pack", lambda *a, **k: pytest.fail("packed a cached weight"))
    second = _load(q4_model, cache)
    assert second.fingerprint == first.fingerprint  # the same cache identity: parked conversations stay valid
    for a, b in zip(_weights(first), _weights(second), strict=True):
        assert isinstance(b, int4.Int4Weight)
        assert same(a, b)
    assert torch.equal(_logits(first), _logits(second))


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_a_damaged_cache_file_is_refused_and_written_again(q4_model, tmp_path, caplog, damage):
    cache = str(tmp_path / "weights")
    reference = _load(q4_model, cache)
    path = os.path.join(cache, _cache_files(cache)[0])
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        if damage == "flip":  # a byte of the last tensor's data
            f.seek(size - 10)
            byte = f.read(1)
            f.seek(size - 10)
            f.write(bytes([byte[0] ^ 0xFF]))
        elif damage == "truncate":
            f.truncate(size // 2)
        else:
            f.write(b"not a safetensors file at all")
    with caplog.at_level(logging.WARNING, logger="strata.model"):
        again = _load(q4_model, cache)
    assert any("refused" in r.getMessage() for r in caplog.records)
    assert again.fingerprint == reference.fingerprint
    assert torch.equal(_logits(again), _logits(reference))  # converted from the file, not from the damaged cache
    assert os.path.getsize(path) == size  # and kept again, whole
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="strata.model"):
        _load(q4_model, cache)
    assert not caplog.records


def test_a_rewritten_model_file_does_not_use_the_old_weights(tmp_path):
    cache = str(tmp_path / "weights")
    path = write_tiny_gguf(tmp_path / "a", "llama", qtype="Q4_1", hidden_size=256, intermediate_size=512,
                           head_dim=64, seed=1)
    old = _load(path, cache)
    other = write_tiny_gguf(tmp_path / "b", "llama", qtype="Q4_1", hidden_size=256, intermediate_size=512,
                            head_dim=64, seed=2)
    os.replace(other, path)  # the same name, other weights
    new = _load(path, cache)
    assert new.fingerprint != old.fingerprint
    assert not torch.equal(_logits(new), _logits(old))
    assert torch.equal(_logits(new), _logits(_load(path, None)))
    assert len(_cache_files(cache)) == 2


def test_only_the_newest_cache_files_are_kept(tmp_path):
    cache = str(tmp_path / "weights")
    for seed in range(KEEP + 2):
        path = write_tiny_gguf(tmp_path / str(seed), "llama", qtype="Q4_1", hidden_size=128, intermediate_size=256,
                               head_dim=32, seed=seed)
        _load(path, cache)
    assert len(_cache_files(cache)) == KEEP


def test_serve_keeps_converted_weights_unless_told_off(q4_model, tmp_path):
    xdg = {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
    folder = tmp_path / "xdg" / "strata" / "weights"
    engine = start_engine("--model", q4_model, "--conversation-cache-mib", "0", "--weights-cache", "off", env=xdg)
    engine.stop()
    assert not folder.exists()
    engine = start_engine("--model", q4_model, "--conversation-cache-mib", "0", env=xdg)
    engine.stop()
    assert len(_cache_files(folder)) == 1
    engine = start_engine("--model", q4_model, "--conversation-cache-mib", "0", env=xdg)
    try:
        assert "weights cache: " in engine.logs() and " weights from " in engine.logs()
    finally:
        engine.stop()


def test_a_cached_weight_of_another_shape_is_converted_again(q4_model, tmp_path, caplog):
    from engine.model.gguf_header import read_gguf_header
    from engine.model.weights_cache import DerivedWeights

    cache = str(tmp_path / "weights")
    reference = _load(q4_model, None)
    stages = plan_stages(reference.config.n_layers, "cpu", "")
    options = {"dtype": str(torch.float32), "stages": [[str(d), a, b] for d, a, b in stages]}
    planted = DerivedWeights(cache, q4_model, read_gguf_header(q4_model).data_offset, options)
    planted.put("0.wqkv", int4.Int4Weight(torch.randn(64, 256)))  # a shape no layer of this model has
    planted.save(reference.fingerprint)
    assert len(_cache_files(cache)) == 1  # the planted file is the one this load looks for
    with caplog.at_level(logging.WARNING, logger="strata.model"):
        loaded = _load(q4_model, cache)
    assert any("converting it from the model file" in r.getMessage() for r in caplog.records)
    assert torch.equal(_logits(loaded), _logits(reference))


def test_the_built_tokenizer_is_kept_and_a_damaged_one_rebuilt(q4_model, tmp_path, monkeypatch, caplog):
    from engine.model.tokenizer import Tokenizer

    cache = str(tmp_path / "weights")
    texts = ["The quick brown fox.", "  spaces, ünïcödé and 日本語 ", "<|im_start|>user\nhi<|im_end|>"]
    first = _load(q4_model, cache)
    kept = [n for n in os.listdir(cache) if n.endswith(".tokenizer.json")]
    assert len(kept) == 1
    with monkeypatch.context() as patch:  # a kept tokenizer is not built again
        patch.setattr(Tokenizer, "_gguf_backend", lambda *a: pytest.fail("built a kept tokenizer"))
        second = _load(q4_model, cache)
    assert second.tokenizer.fingerprint == first.tokenizer.fingerprint and second.fingerprint == first.fingerprint
    for text in texts:
        assert second.tokenizer.encode(text) == first.tokenizer.encode(text)
        assert second.tokenizer.decode(first.tokenizer.encode(text)) == first.tokenizer.decode(first.tokenizer.encode(text))
    path = os.path.join(cache, kept[0])
    with open(path, "r+b") as f:  # one byte of the serialised tokenizer, near the end of the file
        f.seek(-200, os.SEEK_END)
        byte = f.read(1)
        f.seek(-200, os.SEEK_END)
        f.write(b"Z" if byte != b"Z" else b"Y")
    with caplog.at_level(logging.WARNING, logger="strata.model"):
        third = _load(q4_model, cache)
    assert any("tokenizer" in r.getMessage() and "refused" in r.getMessage() for r in caplog.records)
    assert [third.tokenizer.encode(t) for t in texts] == [first.tokenizer.encode(t) for t in texts]
    assert os.path.isfile(path)  # written again
