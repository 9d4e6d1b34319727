"""--kv-dtype: K/V kept in float32, bfloat16 or float16, attention in the compute dtype; the dtype is part of
the conversation cache's identity, so a conversation parked in one dtype never reaches a slot of another."""

from __future__ import annotations

import os

import pytest
import torch

from engine.cache import SessionFileError
from engine.cache.session_file import load_session, save_session
from engine.config import EngineConfig
from engine.kv import KVBuffers, KVLayout
from engine.model import SeqChunk, load_model, plan_stages
from engine.model.loader import resolve_kv_dtype
from tests.model_fixtures import write_tiny_model
from tests.test_cache_disk import check_restores, folder_of, our_files
from tests.test_cache_support import BLOCK, FakeSlots, conversation, identity, make_cache, park_tokens

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Largest relative L2 distance of a position's logits from those with float32 K/V: bfloat16 keeps 8 bits of
# mantissa, float16 11. Measured on the tiny random-weight model (84 positions): bfloat16 2.5 % at worst (1.1 %
# on average, same argmax at 83 of 84), float16 0.35 % (0.12 %, every argmax the same).
LOGITS_RTOL = {"bfloat16": 5e-2, "float16": 1e-2}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("kv-dtype"), "llama")


def test_auto_is_the_compute_dtype_and_names_are_checked():
    assert resolve_kv_dtype("auto", torch.float32) is torch.float32  # CPU
    assert resolve_kv_dtype("auto", torch.bfloat16) is torch.bfloat16  # CUDA
    assert resolve_kv_dtype("float16", torch.float32) is torch.float16
    with pytest.raises(ValueError, match="kv_dtype: expected one of auto, float32, bfloat16, float16"):
        resolve_kv_dtype("int8", torch.float32)
    with pytest.raises(ValueError, match="--kv-dtype"):
        EngineConfig(kv_dtype="fp8").validate()


def _logits(lm, kv_dtype: torch.dtype, ids: torch.Tensor, n_decode: int) -> torch.Tensor:
    """Prefill all but `n_decode` tokens in two chunks, then decode the rest one at a time (teacher-forced)."""
    c = lm.config
    kv = KVBuffers(KVLayout(c.n_layers, c.n_kv_heads, c.head_dim, kv_dtype), 1, 256, lm.model.stages)
    n = len(ids) - n_decode
    half = n // 2
    rows = [lm.model.forward_chunks([SeqChunk(0, 0, ids[:half])], kv, all_logits=True)[0]]
    rows.append(lm.model.forward_chunks([SeqChunk(0, half, ids[half:n])], kv, all_logits=True)[0])
    for pos in range(n, len(ids)):
        rows.append(lm.model.forward_chunks([SeqChunk(0, pos, ids[pos : pos + 1])], kv))
    assert kv.stages[0].k.dtype == kv_dtype
    return torch.cat(rows)


@pytest.mark.parametrize("name", ["bfloat16", "float16"])
def test_logits_with_16_bit_kv_stay_close_to_float32(tiny_model, name):
    lm = load_model(tiny_model, plan_stages(3, "cpu", ""), torch.float32)
    ids = torch.tensor(lm.tokenizer.encode("The conversation cache parks attention state in RAM or on disk. " * 3))
    ref = _logits(lm, torch.float32, ids, 6)
    got = _logits(lm, DTYPES[name], ids, 6)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    rel = ((got - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    assert 0 < rel < LOGITS_RTOL[name], rel  # not bit-identical (the K/V really is rounded), but close
    assert not torch.equal(got, ref)


@pytest.mark.parametrize("name", list(DTYPES))
@pytest.mark.parametrize("storage", ["ram", "disk"])
def test_cache_round_trip_is_byte_exact_in_each_dtype(tmp_path, name, storage):
    layout = KVLayout(n_layers=4, n_kv_heads=2, head_dim=16, dtype=DTYPES[name])
    ident = identity(layout=layout)
    cache, slots = make_cache(ident, storage=storage, dir=str(tmp_path)), FakeSlots(layout)
    tokens = conversation(1, 5 * BLOCK + 7)
    result = park_tokens(cache, slots, tokens)
    assert result.parked and result.new_bytes >= len(tokens) * layout.bytes_per_token
    assert cache.flush(10)
    check_restores(cache, slots, tokens)  # torch.equal on the restored rows
    cache.close(spill=False)
    if storage == "disk":  # and again from the files, after a restart
        again = make_cache(ident, storage="disk", dir=str(tmp_path))
        assert check_restores(again, slots, tokens).tier == "disk"
        again.close(spill=False)


def test_parked_bytes_per_token_follow_the_kv_dtype():
    wide, narrow = (identity(layout=KVLayout(4, 2, 16, d)) for d in (torch.float32, torch.bfloat16))
    assert narrow.bytes_per_token * 2 == wide.bytes_per_token and narrow.key != wide.key


def test_a_conversation_parked_in_one_dtype_is_never_restored_into_another(tmp_path, caplog):
    f32, bf16 = (KVLayout(4, 2, 16, d) for d in (torch.float32, torch.bfloat16))
    tokens = conversation(2, 4 * BLOCK + 3)
    first = make_cache(identity(layout=f32), storage="disk", dir=str(tmp_path))
    park_tokens(first, FakeSlots(f32), tokens)
    assert first.flush(10)
    f32_folder = folder_of(first)
    first.close(spill=False)
    # the same model with bfloat16 K/V has another identity: its own folder, so the parked conversation is a miss
    second = make_cache(identity(layout=bf16), storage="disk", dir=str(tmp_path))
    assert folder_of(second) != f32_folder and second.conversations() == []
    assert second.lookup(tokens + [1]) is None
    second.close(spill=False)
    # float32 files copied into the bfloat16 folder are foreign there: removed at start, never adopted
    bf16_folder = os.path.join(str(tmp_path), identity(layout=bf16).key)
    for name in our_files(f32_folder):
        os.link(os.path.join(f32_folder, name), os.path.join(bf16_folder, name))
    with caplog.at_level("INFO", logger="strata.cache"):
        third = make_cache(identity(layout=bf16), storage="disk", dir=str(tmp_path))
    assert third.conversations() == [] and our_files(bf16_folder) == []
    assert "'foreign'" in caplog.text
    third.close(spill=False)
    # a slot file saved with float32 K/V is refused by a bfloat16 engine, naming the dtype
    path = str(tmp_path / "slot.bin")
    slots = FakeSlots(f32)
    slots.fill(0, tokens)
    save_session(path, identity(layout=f32), tokens, slots.snapshot(0, len(tokens)), engine_version="test")
    with pytest.raises(SessionFileError, match=r"layout\.dtype: bfloat16 here, float32 in the file"):
        load_session(path, identity(layout=bf16))
    assert load_session(path, identity(layout=f32))[0] == tokens


def test_the_engine_keeps_kv_in_the_chosen_dtype(tiny_model):
    from engine.runtime.engine import Engine

    sizes = {}
    for name in ("auto", "bfloat16"):
        engine = Engine.from_config(EngineConfig(model=tiny_model, devices="cpu", ctx_size=256,
                                                 kv_dtype=name, conversation_cache_mib=16,
                                                 conversation_cache_min_free_mib=0))
        try:
            figures = engine.stats_snapshot()["engine"]
            assert engine.kv.stages[0].k.dtype == (torch.float32 if name == "auto" else torch.bfloat16)
            assert figures.kv_dtype == ("float32" if name == "auto" else "bfloat16")
            assert engine.cache_identity is not None
            assert engine.cache_identity.describe()["layout"]["dtype"] == figures.kv_dtype
            sizes[name] = figures.kv_bytes
        finally:
            engine.close()
    assert sizes["bfloat16"] * 2 == sizes["auto"]


@pytest.mark.parametrize("name", ["bfloat16", "float16"])
@pytest.mark.parametrize("storage", ["ram", "disk"])
def test_a_restored_conversation_continues_as_if_it_never_left_with_16_bit_kv(tiny_model, storage, name):
    """A, B, A with the K/V in `name`: the restored slot rows are byte-identical and the greedy output is the
    same as the engine's own run that never parked A (tools/conversation_cache_parity.py)."""
    from tools.conversation_cache_parity import run_restart, run_scenario

    base = {"model": tiny_model, "devices": "cpu", "ctx_size": 2048, "conversation_cache_storage": storage,
            "conversation_cache_min_free_mib": 0, "kv_dtype": name}
    outcome = run_scenario("basic", base, n_words=60, max_tokens=12)
    assert outcome.passed, outcome.detail
    if storage == "disk":  # and from the files, in a new engine
        outcome = run_restart(base, {}, n_words=60, max_tokens=12)
        assert outcome.passed, outcome.detail
