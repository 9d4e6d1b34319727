"""Parking only the window: a sliding-window model's parked conversation keeps its global layers' K/V whole and
its local layers' last window only (engine/cache/window.py), and still continues token for token as one that
never left its slot.

Tiny random Gemma 3 (five local layers per global one) and Mistral (every layer local) with a window of 8 and
blocks of 16 tokens, over conversations of ~400 tokens (50 windows): A/B/A parity in ram, disk and tiered
storage (every scenario of tools/conversation_cache_parity.py; an edited first message, which leaves A before
its window, prefills and says why: reason `window`), a restart, the parked bytes per layer kind, the slot that was
restored from a window not forked before it, slot files, which keep every row, and files parked before windows
were, refused at start as another model's.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from engine.config import EngineConfig
from engine.errors import BadValue
from engine.runtime.engine import Engine
from tests.model_fixtures import SLIDING, write_tiny_model
from tests.test_cache_support import FakeSlots, conversation, identity, make_cache, park_tokens
from tools.conversation_cache_parity import (
    SCENARIOS,
    _conversation,
    _generate,
    _text,
    run_restart,
    run_scenario,
)

WINDOW, BLOCK = 8, 16


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("window-parking")
    return {arch: write_tiny_model(root, arch, **SLIDING[arch]) for arch in ("gemma3", "mistral")}


def _base(model: str, storage: str, **more) -> dict:
    return {"model": model, "devices": "cpu", "ctx_size": 2048, "conversation_cache_storage": storage,
            "conversation_cache_min_free_mib": 0, "conversation_cache_block_tokens": BLOCK, **more}


@pytest.mark.parametrize("storage", ["ram", "disk", "tiered"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_gemma3_parked_window_continues_as_if_it_never_left(models, storage, scenario):
    outcome = run_scenario(scenario, _base(models["gemma3"], storage), n_words=60, max_tokens=12)
    assert outcome.passed, outcome.detail
    if scenario == "edited":
        assert "reason window" in outcome.detail


@pytest.mark.parametrize("storage", ["ram", "disk", "tiered"])
@pytest.mark.parametrize("scenario", ["basic", "edited"])
def test_mistral_every_layer_local_continues_as_if_it_never_left(models, storage, scenario):
    outcome = run_scenario(scenario, _base(models["mistral"], storage), n_words=60, max_tokens=12)
    assert outcome.passed, outcome.detail


@pytest.mark.parametrize(("arch", "storage"), [("gemma3", "disk"), ("gemma3", "tiered"), ("mistral", "disk")])
def test_restart_resumes_the_parked_window(models, arch, storage):
    outcome = run_restart(_base(models[arch], storage), {}, n_words=60, max_tokens=8)
    assert outcome.passed, outcome.detail


def _parked_a(engine: Engine, n_tokens: int):
    """Conversation A's entry in the tier that holds it, and that tier's index."""
    cache = engine.cache
    for _, index in cache.tiers():
        for conv in index.convs.values():
            if conv.n_tokens == n_tokens:
                return conv, index
    raise AssertionError(f"no parked conversation of {n_tokens} tokens")


@pytest.mark.parametrize("storage", ["ram", "disk"])
def test_parked_bytes_of_a_local_layer_are_bounded_by_its_window(models, storage, tmp_path):
    """A conversation 50 windows long: its local layers park at most W - 1 + one block rows, its global layers
    every row; the conversation list counts exactly those bytes; A's next turn is the never-parked engine's."""
    config = EngineConfig(**_base(models["gemma3"], storage, conversation_cache_dir=str(tmp_path / "c"),
                                  slot_save_path=str(tmp_path / "slots")))
    conv_a = _conversation("You are a careful assistant. " + _text(60, 1), "Summarise this for me.", 3)
    conv_b = _conversation("You write short poems. " + _text(60, 2), "Write about the sea.", 4)
    ref = Engine.from_config(config.replace(conversation_cache_dir=str(tmp_path / "ref")))
    try:
        a1, _, _ = _generate(ref, conv_a, 4)
        turn2 = conv_a + [{"role": "assistant", "content": a1}, {"role": "user", "content": "Go on."}]
        _, ref_tokens, _ = _generate(ref, turn2, 12)
        edited = [conv_a[0], {"role": "user", "content": "Something else entirely. " + _text(30, 9)}]
        _, ref_edited, _ = _generate(ref, edited, 8)
    finally:
        ref.close()

    eng = Engine.from_config(config)
    try:
        _generate(eng, conv_a, 4)
        n_a = len(eng.slots[0].tokens)
        assert n_a > 40 * WINDOW
        _generate(eng, conv_b, 4)  # parks A
        assert eng.call(eng.cache.flush).result()
        conv, index = eng.call(lambda: _parked_a(eng, n_a)).result()
        ident = eng.cache.identity
        layout = eng.layout
        local = len(ident.local_layers)
        assert (local, layout.n_layers - local) == (5, 1)  # tiny Gemma 3: 5 local layers, then a global one
        row = layout.bytes_per_token // layout.n_layers  # one layer's K/V of one token
        assert ident.bytes_per_token == row  # blocks and tails: the global layer only
        # the local layers: one window checkpoint, at most W - 1 + one block of rows
        (position,) = conv.checkpoints
        rows = eng.call(lambda: index_window_rows(eng, conv, index)).result()
        assert rows == n_a - max(0, position - WINDOW + 1) <= WINDOW - 1 + BLOCK
        listed = {c["id"]: c for c in eng.call(eng.cache_conversations).result()}[conv.id]
        global_bytes = n_a * row
        window_bytes = rows * local * row
        if storage == "ram":
            assert listed["bytes"] == global_bytes + window_bytes + 4 * n_a  # + the token ids
            assert listed["bytes"] < n_a * layout.bytes_per_token / 3  # every layer's K/V: 6 times the global's
        else:  # files: a 4096-byte aligned header on each of them (this model's blocks are 1 KiB of K/V)
            payload = global_bytes + window_bytes + 4 * n_a
            assert payload < listed["bytes"] <= payload + (len(conv.keys) + 1) * 3 * 4096

        _, tokens, cached = _generate(eng, turn2, 12)
        assert tokens == ref_tokens and cached >= n_a
        slot = next(s for s in eng.slots if s.tokens[:n_a] == list(conv.tokens))
        assert eng.memory.windows.floors[slot.id] > 0  # restored from a window: older local rows are not its own
        with pytest.raises(BadValue, match="last window"):
            eng.call(lambda: eng.save_slot(slot.id, "a.bin")).result()
        # a prompt leaving A before that slot's window is not computed from it: the never-parked answer
        _, tokens, _ = _generate(eng, edited, 8)
        assert tokens == ref_edited
    finally:
        eng.close()


def index_window_rows(engine: Engine, conv, index) -> int:
    """The rows of `conv`'s window checkpoint, from RAM or its manifest."""
    (position,) = conv.checkpoints
    parts = conv.checkpoints[position]
    if parts is None:
        parts = engine.cache.disk.files.read_checkpoints(conv)[position]
    (window,) = parts.values()
    return window.shape[2]


def test_a_slot_file_keeps_every_row_and_restores(models, tmp_path):
    config = EngineConfig(**_base(models["gemma3"], "ram", slot_save_path=str(tmp_path), parallel=2))
    eng = Engine.from_config(config)
    try:
        _generate(eng, _conversation("Hello. " + _text(40, 1), "Go.", 2), 4)
        kv = eng.call(lambda: eng.kv.read(0, 0, len(eng.slots[0].tokens))).result()
        eng.call(lambda: eng.save_slot(0, "s.bin")).result()
        eng.call(lambda: eng.erase_slot(0)).result()
        eng.call(lambda: eng.restore_slot(1, "s.bin")).result()
        back = eng.call(lambda: eng.kv.read(1, 0, kv.shape[2])).result()
        assert torch.equal(back.view(torch.uint8), kv.view(torch.uint8))
        assert os.path.getsize(tmp_path / "s.bin") > kv.nbytes
    finally:
        eng.close()


def test_files_parked_with_every_layer_are_refused_as_another_models(tmp_path):
    """The files of a windowed model written before window parking (every layer in its blocks) are another
    identity's: copied into this identity's folder they are removed at start, never restored."""
    windowed = dataclasses.replace(identity(), window=WINDOW, local_layers=(0, 1, 2))
    assert windowed.key != identity().key and windowed.parts[0].dims[0] == 1  # one global layer of four
    old = make_cache(identity(), storage="disk", dir=str(tmp_path / "old"))
    park_tokens(old, FakeSlots(), conversation(5, 3 * 16 + 4))
    assert old.flush(10)
    old_folder = old.stats().dir
    old.close(spill=False)
    new = make_cache(windowed, storage="disk", dir=str(tmp_path / "new"))
    new_folder = new.stats().dir
    new.close(spill=False)
    names = [n for n in os.listdir(old_folder) if n.endswith(".safetensors")]
    assert len(names) == 4  # three blocks and the manifest
    for name in names:
        os.replace(os.path.join(old_folder, name), os.path.join(new_folder, name))
    again = make_cache(windowed, storage="disk", dir=str(tmp_path / "new"))
    try:
        assert again.conversations() == []
        assert not [n for n in os.listdir(new_folder) if n.endswith(".safetensors")]
    finally:
        again.close(spill=False)


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_a_parked_window_resumes_on_another_engine_through_a_shared_store(models, arch, tmp_path):
    """Engine A parks a conversation (global layers' blocks, the local layers' window) through to a real
    redis-server; engine B, with its own folder, resumes it there token for token as the never-parked engine."""
    from tests.redis_server import resume_through_store

    conv_a = _conversation("You are a careful assistant. " + _text(60, 1), "Summarise this for me.", 3)
    seen = resume_through_store(EngineConfig(**_base(models[arch], "tiered")), conv_a, tmp_path)
    assert seen.resumed == seen.reference and seen.cached >= seen.first_prompt  # the first prompt at least
    assert seen.stats["remote_hits"] == 1 and seen.stats["remote_refused"] == 0
