"""`--spec mtp`: the next-token layer's K/V and the target's hidden rows parked with the conversation, restored with
it (RAM, tiered, disk after a restart), so a switch-back drafts at once; a damaged part is refused alone and the
answer stays the target's own (a tiny random GLM-4.x MoE with its MTP layer)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.runtime.engine import Engine
from engine.runtime.requests import GenerationRequest, SamplingParams

pytest.importorskip("transformers")

FIRST = list(range(5, 45))
OTHER = [9, 10, 11] * 12


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    from tests.moe_fixtures import write_tiny_moe_model

    return write_tiny_moe_model(tmp_path_factory.mktemp("glm4-mtp-park"), "glm4_moe", seed=3)


def _config(folder: str, storage: str, cache_dir: Path | None, spec: str = "mtp") -> EngineConfig:
    return EngineConfig(model=folder, ctx_size=256, cpu_weights="float", spec=spec, conversation_cache_storage=storage,
                        conversation_cache_dir=str(cache_dir) if cache_dir else "", conversation_cache_min_free_mib=0)


def _answer(engine: Engine, prompt: list[int], name: str, max_tokens: int = 12) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    out = []
    for event in engine.submit(GenerationRequest(name, prompt, params)):
        assert event.error is None, event.error
        if event.token_id is not None:
            out.append(event.token_id)
    return out


def _record(engine: Engine):
    return engine.call(lambda: engine.stats.requests.snapshot()[-1]).result()


def _layer_state(engine: Engine, tokens: list[int]) -> dict[str, torch.Tensor]:
    """Slot 0's parts for `tokens`, as a park takes them (the layer caught up to them first)."""
    source = engine.draft_states.draft

    def read() -> dict[str, torch.Tensor]:
        n = source.parkable(0, tokens)
        assert n == len(tokens), (n, len(tokens))
        return {k: t.clone() for k, t in source.read_rows(0, 0, n).items()}

    return engine.call(read).result()


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _next_turn(first: list[int]) -> list[int]:
    return FIRST + first + [12, 13, 14, 15]


def _play_switch_back(engine: Engine) -> tuple[list[int], list[int]]:
    first = _answer(engine, FIRST, "first")
    _answer(engine, OTHER, "other", 4)  # takes the one slot: the first conversation is parked
    return first, _answer(engine, _next_turn(first), "again")


def test_the_layer_s_rows_roundtrip_between_slots_and_draft_at_once(folder):
    from engine.kv import KVBuffers, KVLayout
    from engine.model import SeqChunk, load_model, plan_stages
    from engine.model.loader import read_model_config
    from engine.model.mtp_layer import MtpBlock
    from engine.runtime.mtp_drafts import MtpSource

    lm = load_model(folder, plan_stages(read_model_config(folder).n_layers, "cpu", ""), torch.float32)
    c = lm.config
    kv = KVBuffers(KVLayout(c.n_layers, c.n_kv_heads, c.head_dim, lm.dtype), 2, 128, lm.model.stages)
    source = MtpSource(lm.model, 2, 128)
    seq = [(7 * i) % 300 + 3 for i in range(30)]
    try:
        lm.model.forward_chunks([SeqChunk(1, 0, torch.tensor(seq[:24]))], kv)
        assert source.propose(1, seq[:21], 3)  # the layer reads up to 21 tokens, then lags behind the target
        assert source.parkable(1, seq[:24]) == 24 and source.held[1] == seq[:24]  # caught up to what is parked
        parts = source.read_rows(1, 0, 24)
        assert parts["kv"].shape == (1, 2, 24, *source.block.kv_shape) and parts["hidden"].shape[0] == 24
        source.forget(0)
        for lo, hi in ((0, 16), (16, 24)):  # in pieces, as blocks come back
            source.write_rows(0, lo, {"kv": parts["kv"][:, :, lo:hi], "hidden": parts["hidden"][lo:hi]})
        source.restored(0, seq[:24])
        assert _equal(source.read_rows(0, 0, 24), parts)
        assert source.propose(0, seq[:25], 3) == source.propose(1, seq[:25], 3)  # drafts at once, the same
        assert source.reused[0] == 24
        assert source.parkable(0, seq[:40]) == 24  # what its rows cover, no more
        # restored without the layer's part: the target's rows from 24 on only, and the layer drafts from there
        source.restored_without(0)
        lm.model.forward_chunks([SeqChunk(0, 24, torch.tensor(seq[24:28]))], kv)
        assert source.target.first[0] == 24 and source.parkable(0, seq[:28]) == 0  # nothing whole to park
        block = MtpBlock(lm.model, lm.model.mtp[0])
        logits, _ = block.forward(torch.tensor(seq[25:29]), source.target.get(0, 24, 28), 24, block.new_cache(64), 24)
        assert source.propose(0, seq[:29], 1) == [int(logits[-1].argmax())]
        assert source.propose(0, seq[:23], 1) == []  # before the rows it has
    finally:
        lm.model.hidden_rows = None


@pytest.mark.parametrize("storage", ["ram", "tiered", "disk"])
def test_switch_back_restores_the_layer_s_state_and_drafts_at_once(folder, tmp_path, storage):
    engine = Engine.from_config(_config(folder, storage, tmp_path / "on" if storage != "ram" else None))
    try:
        first = _answer(engine, FIRST, "first")
        parked = FIRST + first[:-1]  # the last token sampled was never fed
        before = _layer_state(engine, parked)
        _answer(engine, OTHER, "other", 4)  # takes the one slot: the first conversation is parked
        again = _answer(engine, _next_turn(first), "again")
        record = _record(engine)
        assert record.source == ("disk" if storage == "disk" else "ram") and record.reused_tokens == len(parked)
        # the layer read none of the tokens parked, and drafted from its first decode steps
        assert record.spec_draft_reused == len(parked) and record.spec_drafted > 0, record
        assert engine.draft_states.restored == 1 and engine.draft_states.refused == 0
        assert _equal(_layer_state(engine, parked), before)  # bit for bit
        _answer(engine, OTHER, "other", 4)  # parks the second turn, the layer's part with it
        _check_drop_takes_the_layer_s_part(engine)
    finally:
        engine.close()
    off = Engine.from_config(_config(folder, storage, tmp_path / "off" if storage != "ram" else None, spec="off"))
    try:
        assert _play_switch_back(off) == (first, again)  # the target's own answers, token for token
    finally:
        off.close()


def _check_drop_takes_the_layer_s_part(engine: Engine) -> None:
    control = engine.control

    def drop_one() -> tuple[bool, bool]:
        assert control.draft_cache is not None
        conv_id, part_id = next(iter(control.draft_parts.items()))
        before = {c.id for c in control.draft_cache.conversations()}
        control.drop_conversation(conv_id)
        return part_id in before, part_id in {c.id for c in control.draft_cache.conversations()}

    assert engine.call(drop_one).result() == (True, False)


def _first_turn_then_restart(folder: str, cache_dir: Path) -> tuple[list[int], dict[str, torch.Tensor]]:
    engine = Engine.from_config(_config(folder, "disk", cache_dir))
    try:
        first = _answer(engine, FIRST, "first")
        before = _layer_state(engine, FIRST + first[:-1])
    finally:
        engine.close()  # disk storage: the slot is parked at shutdown, the layer's rows beside it
    return first, before


def _off_answers(folder: str, cache_dir: Path, prompt: list[int]) -> tuple[list[int], list[int]]:
    engine = Engine.from_config(_config(folder, "disk", cache_dir, spec="off"))
    try:
        return _answer(engine, FIRST, "first"), _answer(engine, prompt, "again")
    finally:
        engine.close()


def test_a_restart_adopts_the_layer_s_state_bit_for_bit_and_drafts_at_once(folder, tmp_path):
    first, before = _first_turn_then_restart(folder, tmp_path)
    parked, prompt = FIRST + first[:-1], _next_turn(first)
    engine = Engine.from_config(_config(folder, "disk", tmp_path))
    try:
        again = _answer(engine, prompt, "again")
        record = _record(engine)
        assert record.source == "disk" and record.reused_tokens == len(parked)
        assert record.spec_draft_reused == len(parked) and record.spec_drafted > 0, record
        assert engine.draft_states.restored == 1
        assert _equal(_layer_state(engine, parked), before)  # bit for bit
    finally:
        engine.close()
    assert _off_answers(folder, tmp_path / "off", prompt) == (first, again)


@pytest.mark.parametrize("damage", ["flipped", "truncated"])
def test_a_damaged_layer_part_is_refused_alone_and_the_answer_is_the_same(folder, tmp_path, damage):
    first, _ = _first_turn_then_restart(folder, tmp_path)
    engine = Engine.from_config(_config(folder, "disk", tmp_path / "kept"))
    layer_folder = tmp_path / engine.control.draft_identity.key
    engine.close()
    files = sorted(layer_folder.glob("*.safetensors"))
    assert files, sorted(p.name for p in tmp_path.iterdir())
    for path in files:  # one byte flipped in the middle of each (every checksum fails), or cut there
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data if damage == "flipped" else data[: len(data) // 2]))
    prompt = _next_turn(first)
    engine = Engine.from_config(_config(folder, "disk", tmp_path))
    try:
        again = _answer(engine, prompt, "again")
        record = _record(engine)
        assert record.source == "disk" and record.reused_tokens > 0  # the model's part restored
        assert engine.draft_states.restored == 0 and record.spec_draft_reused == 0
        assert record.spec_drafted > 0, record  # from the rows computed after the restore
        # a flipped byte is refused at the restore; a cut file already at the start-up scan (never found)
        assert engine.draft_states.refused == (damage == "flipped")
    finally:
        engine.close()
    assert _off_answers(folder, tmp_path / "off", prompt) == (first, again)


def test_the_layer_s_identity_is_its_own(folder):
    from engine.model import load_model, plan_stages
    from engine.model.loader import read_model_config
    from engine.runtime.draft_states import mtp_identity
    from engine.runtime.identity import cache_identity, int4_kernel
    from engine.runtime.memory import AttentionMemory
    from engine.runtime.mtp_drafts import MtpSource

    lm = load_model(folder, plan_stages(read_model_config(folder).n_layers, "cpu", ""), torch.float32)
    from engine.kv import KVBuffers, KVLayout

    c = lm.config
    kv = KVBuffers(KVLayout(c.n_layers, c.n_kv_heads, c.head_dim, lm.dtype), 1, 64, lm.model.stages)
    model = cache_identity(lm, "float", int4_kernel(lm.model, "float"), kv.layout, 16, AttentionMemory(kv))
    try:
        ident = mtp_identity(model, MtpSource(lm.model, 1, 64))
    finally:
        lm.model.hidden_rows = None
    # another key than the model's (so neither's files are taken for the other's), and both parts described
    assert ident.key != model.key and ident.model["role"] == "mtp"
    assert [p["name"] for p in ident.describe()["parts"]] == ["kv", "hidden"]
    assert ident.bytes_per_token == 2 * c.n_kv_heads * c.head_dim * 4 + c.hidden_size * 4


def test_a_slot_file_restored_over_a_longer_conversation_drafts_from_its_own_rows(folder, tmp_path):
    """The next-token layer must not take the rows it computed for the slot's earlier conversation as the restored
    one's context (it would find them disagree with the slot's tokens and never draft)."""
    config = _config(folder, "ram", None).replace(slot_save_path=str(tmp_path))
    engine = Engine.from_config(config)
    try:
        other = _answer(engine, OTHER, "other", 4)
        engine.call(lambda: engine.save_slot(0, "other.bin")).result()
        _answer(engine, FIRST + list(range(50, 80)), "longer")  # slot 0 now holds a longer conversation
        engine.call(lambda: engine.restore_slot(0, "other.bin")).result()
        _answer(engine, OTHER + other + [12, 13, 14, 15], "again")
        record = _record(engine)
        assert record.reused_tokens >= len(OTHER), record  # the slot held the restored conversation
        assert record.spec_drafted > 0, record
    finally:
        engine.close()
