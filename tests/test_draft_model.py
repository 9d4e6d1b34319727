"""Speculative decoding with a draft model (`--spec draft --model-draft PATH`): greedy output token-identical with
and without it (tiny random models, the draft made from the same config with fewer layers; two slots at once; a
parked conversation restored), and the refusals at start (no draft given, another vocabulary)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.errors import ModelLoadError
from engine.runtime.engine import Engine
from engine.runtime.requests import GenerationRequest, SamplingParams
from engine.runtime.slot_set import common_prefix
from engine.setting import SettingError
from tests.model_fixtures import write_tiny_model

LOOPING = ["one two three " * 20, "alpha beta " * 30]


def write_truncated(target: str, folder: Path, n_layers: int) -> str:
    """A draft made from the target: its first `n_layers` layers, its embeddings, final norm and output."""
    from safetensors.torch import load_file, save_file

    folder.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(target) / name, folder / name)
    config = json.loads((Path(target) / "config.json").read_text(encoding="utf-8"))
    config["num_hidden_layers"] = n_layers
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    weights = load_file(str(Path(target) / "model.safetensors"))
    kept = {k: v for k, v in weights.items() if not k.startswith("model.layers.")
            or int(k.split(".")[2]) < n_layers}
    save_file(kept, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return str(folder)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    # Small initial weights: a random model that falls into loops; its first layers alone mostly follow it.
    root = tmp_path_factory.mktemp("draft")
    target = write_tiny_model(root, "llama", name="target", initializer_range=0.01)
    return {"target": target, "draft": write_truncated(target, root / "draft", 2)}


def _chat(engine: Engine, text: str) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.render_chat([{"role": "user", "content": text}]), add_special_tokens=False)


def _answer(engine: Engine, prompt: list[int], max_tokens: int, name: str = "a") -> tuple[list[int], int]:
    """A greedy answer's tokens and the prompt tokens it reused."""
    tokens, cached = [], 0
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for event in engine.submit(GenerationRequest(f"draft-{name}-{len(prompt)}", prompt, params)):
        assert event.error is None, event.error
        if event.token_id is not None:
            tokens.append(event.token_id)
        if event.usage is not None:
            cached = event.usage.cached_tokens
    return tokens, cached


def _counters(engine: Engine) -> dict:
    return engine.call(lambda: dict(engine.stats.counters)).result()


def _with_and_without(config: EngineConfig, draft: str, play) -> tuple[object, object, dict]:
    """`play(engine)`'s outcome on an engine without speculation and on one with the draft, and the latter's
    counters."""
    outcomes = []
    for cfg in (config, config.replace(spec="draft", model_draft=draft)):
        engine = Engine.from_config(cfg)
        try:
            outcomes.append(play(engine))
            counters = _counters(engine)
        finally:
            engine.close()
    return outcomes[0], outcomes[1], counters


def test_draft_model_answers_token_identical(models):
    config = EngineConfig(model=models["target"], ctx_size=512, cpu_weights="float")
    off, on, counters = _with_and_without(config, models["draft"], lambda e: [
        _answer(e, _chat(e, ask), 40)[0] for ask in LOOPING])
    assert on == off
    assert counters["spec_drafted_tokens"] > 0 and counters["spec_accepted_tokens"] > 0, counters


def test_model_as_its_own_draft_has_every_draft_accepted(models):
    config = EngineConfig(model=models["target"], ctx_size=512, cpu_weights="float")
    off, on, counters = _with_and_without(config, models["target"], lambda e: _answer(e, _chat(e, LOOPING[0]), 40)[0])
    assert on == off
    assert counters["spec_accepted_tokens"] == counters["spec_drafted_tokens"] > 0, counters


def test_two_slots_draft_each_on_their_own(models):
    config = EngineConfig(model=models["target"], ctx_size=512, cpu_weights="float", parallel=2)

    def both(engine: Engine) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=40)
        streams = [engine.submit(GenerationRequest(f"draft-two-{i}", _chat(engine, ask), params))
                   for i, ask in enumerate(LOOPING)]  # both decode in the same steps
        return [[e.token_id for e in s if e.token_id is not None] for s in streams]

    off, on, counters = _with_and_without(config, models["draft"], both)
    assert on == off
    assert counters["spec_drafted_tokens"] > 0, counters


def test_restored_conversation_continues_identically_with_a_draft(models):
    config = EngineConfig(model=models["target"], ctx_size=512, cpu_weights="float",
                          conversation_cache_storage="ram", conversation_cache_min_free_mib=0)

    def switch_back(engine: Engine) -> tuple[list[int], int, str]:
        ask = "one two three " * 10
        first, _ = _answer(engine, _chat(engine, ask), 24)
        _answer(engine, _chat(engine, "a different conversation " * 12), 8, name="b")  # parks the first
        tok = engine.tokenizer
        turn = [{"role": "user", "content": ask}, {"role": "assistant", "content": tok.decode(first)},
                {"role": "user", "content": "alpha beta " * 10}]
        answer, cached = _answer(engine, tok.encode(tok.render_chat(turn), add_special_tokens=False), 24)
        return answer, cached, engine.call(lambda: engine.stats.requests.snapshot()[-1].source).result()

    off, on, counters = _with_and_without(config, models["draft"], switch_back)
    assert on == off
    assert on[1] > 0 and on[2] == "ram"  # restored from the cache, not continued in a live slot
    assert counters["spec_drafted_tokens"] > 0, counters


def test_spec_draft_without_a_draft_model_is_refused(models, tmp_path):
    with pytest.raises(SettingError, match="--model-draft"):
        EngineConfig(spec="draft")
    missing = str(tmp_path / "no-such-draft")
    config = EngineConfig(model=models["target"], ctx_size=256, cpu_weights="float", spec="draft", model_draft=missing)
    with pytest.raises(ModelLoadError, match=f"--model-draft: {missing}: no such file"):
        Engine.from_config(config)


def test_a_draft_device_that_is_not_one_is_refused(models):
    with pytest.raises(SettingError, match='--device-draft: unknown device "gpu0"; expected cpu or cuda:N'):
        EngineConfig(spec="draft", model_draft=models["draft"], device_draft="gpu0")
    config = EngineConfig(model=models["target"], ctx_size=256, cpu_weights="float", spec="draft",
                          model_draft=models["draft"], device_draft="cuda:99")
    with pytest.raises(ModelLoadError, match="--device-draft: cuda:99 requested but"):
        Engine.from_config(config)


def test_draft_of_another_vocabulary_is_refused_naming_both(models, tmp_path):
    foreign = write_tiny_model(tmp_path, "llama", name="foreign", initializer_range=0.01, num_hidden_layers=1)
    path = Path(foreign) / "tokenizer.json"
    spec = json.loads(path.read_text(encoding="utf-8"))
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens swap ids: the same size, another vocabulary
    path.write_text(json.dumps(spec), encoding="utf-8")
    config = EngineConfig(model=models["target"], ctx_size=256, cpu_weights="float", spec="draft",
                          model_draft=foreign)
    with pytest.raises(ModelLoadError, match="vocabulary") as caught:
        Engine.from_config(config)
    assert foreign in str(caught.value) and "target" in str(caught.value)


# ---------------------------------------------------------------------- the draft's rows parked with the conversation

ASK = "one two three " * 10


def _record(engine: Engine):
    return engine.call(lambda: engine.stats.requests.snapshot()[-1]).result()


def _next_turn(engine: Engine, first: list[int]) -> list[int]:
    tok = engine.tokenizer
    turn = [{"role": "user", "content": ASK}, {"role": "assistant", "content": tok.decode(first)},
            {"role": "user", "content": "alpha beta " * 10}]
    return tok.encode(tok.render_chat(turn), add_special_tokens=False)


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda:0", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                             reason="needs CUDA")])])
def test_a_draft_on_its_own_device_beside_a_cpu_model_answers_as_without(models, device):
    """--device-draft: on a GPU the draft runs in bfloat16 through captured steps, its K/V parked from there; the
    model on the CPU verifies every token, so the answers are the same."""
    config = EngineConfig(model=models["target"], ctx_size=512, cpu_weights="float", devices="cpu",
                          conversation_cache_storage="ram", conversation_cache_min_free_mib=0)

    def turns(engine: Engine) -> tuple[list[list[int]], int, int]:
        first, _ = _answer(engine, _chat(engine, ASK), 24)
        other, _ = _answer(engine, _chat(engine, LOOPING[1]), 16, name="b")  # parks the first, its draft rows too
        again, _ = _answer(engine, _next_turn(engine, first), 24)
        restored = engine.draft_states.restored if engine.draft is not None else 0
        return [first, other, again], _record(engine).spec_draft_reused, restored

    off, on, counters = _with_and_without(config.replace(device_draft=device), models["draft"], turns)
    assert on[0] == off[0]
    assert on[1] > 0 and on[2] == 1  # the switch-back's draft rows came back from host RAM into the draft's K/V
    assert counters["spec_accepted_tokens"] > 0, counters


def _draft_rows(engine: Engine, n: int):
    assert engine.draft is not None
    return engine.call(lambda: engine.draft.kv.read(0, 0, n).clone()).result()


def test_switch_back_restores_the_draft_rows_and_drafts_without_re_reading(models):
    config = EngineConfig(model=models["target"], ctx_size=512, cpu_weights="float", spec="draft",
                          model_draft=models["draft"], conversation_cache_storage="ram",
                          conversation_cache_min_free_mib=0)
    engine = Engine.from_config(config)
    try:
        # the draft's warm-up (a prefill and a step of each batch size) left its slot as it found it
        assert engine.call(lambda: engine.draft.held).result() == [[]]
        assert not _draft_rows(engine, 16).any()
        first, _ = _answer(engine, _chat(engine, ASK), 24)
        held = engine.call(lambda: list(engine.draft.held[0])).result()
        before = _draft_rows(engine, len(held))
        _answer(engine, _chat(engine, "a different conversation " * 12), 8, name="b")  # parks the first
        prompt = _next_turn(engine, first)
        _answer(engine, prompt, 24)
        record = _record(engine)
        assert record.source == "ram" and record.reused_tokens > 0
        # the draft's rows came back with the conversation: its first draft re-read none of the tokens it had
        # held that the new prompt shares (the other conversation's prefill had overwritten them in its slot)
        shared = common_prefix(held, prompt)
        assert record.spec_draft_reused == shared > 0, (record, shared)
        assert engine.draft_states.restored == 1 and engine.draft_states.refused == 0
        assert torch.equal(_draft_rows(engine, shared), before.narrow(2, 0, shared))  # bit for bit
        _answer(engine, _chat(engine, "a different conversation " * 12), 8, name="c")  # parks the second turn
        _check_figures_per_conversation(engine)
        _check_drop_takes_the_draft_part(engine)
        _check_budgets_and_purge(engine)
    finally:
        engine.close()


def _check_drop_takes_the_draft_part(engine: Engine) -> None:
    control = engine.control

    def drop_one() -> tuple[int, int]:
        assert control.draft_cache is not None
        conv_id, draft_id = next(iter(control.draft_parts.items()))
        before = {c.id for c in control.draft_cache.conversations()}
        control.drop_conversation(conv_id)
        after = {c.id for c in control.draft_cache.conversations()}
        return draft_id in before, draft_id in after

    assert engine.call(drop_one).result() == (True, False)


def _check_budgets_and_purge(engine: Engine) -> None:
    """The two caches split the RAM budget, follow a live change of it together, and are purged together."""
    control = engine.control

    def budgets() -> tuple[int, int]:
        assert control.cache is not None and control.draft_cache is not None
        return control.cache.settings.ram_bytes, control.draft_cache.settings.ram_bytes

    ours, theirs = engine.call(budgets).result()
    assert 0 < theirs < ours and ours + theirs <= engine.config.conversation_cache_mib << 20
    engine.call(lambda: control.update({"conversation_cache_mib": 64})).result()
    ours, theirs = engine.call(budgets).result()
    assert 0 < theirs < ours and ours + theirs <= 64 << 20
    assert engine.call(lambda: len(control.draft_cache.conversations())).result() > 0
    engine.call(lambda: control.purge("all")).result()
    assert engine.call(lambda: len(control.draft_cache.conversations())).result() == 0


def _check_figures_per_conversation(engine: Engine) -> None:
    """/metrics (JSON and Prometheus) has each conversation's drafted and accepted tokens: its requests' sums."""
    from engine.contract import MetricsBody
    from engine.server.prometheus import render_prometheus

    snapshot = engine.call(engine.stats.snapshot).result()
    figures = snapshot["engine"]
    sums: dict[str, list[int]] = {}
    for record in snapshot["requests"]:
        if record.spec_drafted and record.conversation_id is not None:  # the others: counted once parked
            totals = sums.setdefault(record.conversation_id, [0, 0])
            totals[0] += record.spec_drafted
            totals[1] += record.spec_accepted
    assert sums and figures.spec_drafted_by_conversation == {c: t[0] for c, t in sums.items()}
    assert figures.spec_accepted_by_conversation == {c: t[1] for c, t in sums.items()}
    text = render_prometheus(MetricsBody(engine=figures, conversation_cache=snapshot["conversation_cache"])).decode()
    for conv, (drafted, accepted) in sums.items():
        assert f'strata_spec_drafted_tokens_by_conversation_total{{conversation="{conv}"}} {float(drafted)}' in text
        assert f'strata_spec_accepted_tokens_by_conversation_total{{conversation="{conv}"}} {float(accepted)}' in text


def _disk_config(models, folder: Path, spec: str = "draft") -> EngineConfig:
    return EngineConfig(model=models["target"], ctx_size=512, cpu_weights="float", spec=spec,
                        model_draft=models["draft"], conversation_cache_storage="disk",
                        conversation_cache_dir=str(folder), conversation_cache_min_free_mib=0)


def _first_turn_then_restart(config: EngineConfig) -> tuple[list[int], list[int], object]:
    """The first turn, parked at shutdown; (its answer, the draft's tokens, the draft's rows then)."""
    engine = Engine.from_config(config)
    try:
        # the draft's warm-up (a prefill and a step of each batch size) left its slot as it found it
        assert engine.call(lambda: engine.draft.held).result() == [[]]
        assert not _draft_rows(engine, 16).any()
        first, _ = _answer(engine, _chat(engine, ASK), 24)
        held = engine.call(lambda: list(engine.draft.held[0])).result()
        rows = _draft_rows(engine, len(held))
    finally:
        engine.close()  # disk storage: the slot is parked, the draft's rows beside it
    return first, held, rows


def test_draft_rows_are_adopted_after_a_restart_byte_identical(models, tmp_path):
    first, held, rows = _first_turn_then_restart(_disk_config(models, tmp_path))
    engine = Engine.from_config(_disk_config(models, tmp_path))
    try:
        prompt = _next_turn(engine, first)
        answer, cached = _answer(engine, prompt, 24)
        record = _record(engine)
        shared = common_prefix(held, prompt)
        assert record.source == "disk" and cached > 0
        assert record.spec_draft_reused == shared > 0, (record, shared)
        assert engine.draft_states.restored == 1  # the rows parked at shutdown, bit for bit
        assert torch.equal(_draft_rows(engine, shared), rows.narrow(2, 0, shared))
    finally:
        engine.close()
    off = Engine.from_config(_disk_config(models, tmp_path / "off", spec="off"))
    try:
        assert _answer(off, _chat(off, ASK), 24)[0] == first
        assert _answer(off, prompt, 24)[0] == answer
    finally:
        off.close()


def test_damaged_draft_part_is_refused_alone_and_the_answer_is_the_same(models, tmp_path):
    first, held, _ = _first_turn_then_restart(_disk_config(models, tmp_path))
    engine = Engine.from_config(_disk_config(models, tmp_path / "kept"))
    draft_folder = tmp_path / engine.control.draft_identity.key
    engine.close()
    files = sorted(draft_folder.glob("*.safetensors"))
    assert files, sorted(p.name for p in tmp_path.iterdir())
    for path in files:  # one byte flipped in the middle of each: every checksum fails
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    engine = Engine.from_config(_disk_config(models, tmp_path))
    try:
        prompt = _next_turn(engine, first)
        damaged, cached = _answer(engine, prompt, 24)
        record = _record(engine)
        assert record.source == "disk" and cached > 0  # the model's part restored
        assert engine.draft_states.refused == 1 and engine.draft_states.restored == 0
        assert record.spec_draft_reused < len(held)  # the draft re-read what it lacked
    finally:
        engine.close()
    engine = Engine.from_config(_disk_config(models, tmp_path / "off", spec="off"))
    try:
        _answer(engine, _chat(engine, ASK), 24)
        assert _answer(engine, prompt, 24)[0] == damaged
    finally:
        engine.close()


def test_draft_catches_up_a_chunk_per_step_and_answers_as_without(models):
    config = EngineConfig(model=models["target"], ctx_size=512, cpu_weights="float")

    def behind(engine: Engine) -> list[int]:
        if engine.draft is not None:
            draft = engine.draft
            seq = _chat(engine, LOOPING[0])[:40]

            def catch_up() -> list[tuple[int, int]]:
                draft.catch_up = 16
                return [(len(draft.propose(1, seq, 4)), len(draft.held[1])) for _ in range(3)]

            # 40 tokens to read: two steps of 16 without drafts, then the last 8 and the draft
            assert engine.call(catch_up).result() == [(0, 16), (0, 32), (4, 43)]
        return _answer(engine, _chat(engine, LOOPING[0]), 40)[0]  # its prompt read in chunks of 16

    off, on, counters = _with_and_without(config.replace(parallel=2), models["draft"], behind)
    assert on == off
    assert counters["spec_accepted_tokens"] > 0, counters


def test_foreign_draft_part_is_never_found_and_the_model_restores_alone(models, tmp_path):
    first, held, _ = _first_turn_then_restart(_disk_config(models, tmp_path))
    other = write_truncated(models["target"], tmp_path / "other-draft", 1)  # another draft: another identity
    engine = Engine.from_config(_disk_config(models, tmp_path).replace(model_draft=other))
    try:
        prompt = _next_turn(engine, first)
        answer, cached = _answer(engine, prompt, 24)
        record = _record(engine)
        assert record.source == "disk" and cached > 0  # the model's part restored
        assert engine.draft_states.restored == engine.draft_states.refused == 0  # the parked draft part: unseen
        assert record.spec_draft_reused < common_prefix(held, prompt)  # the draft re-read it
    finally:
        engine.close()
    engine = Engine.from_config(_disk_config(models, tmp_path / "off", spec="off"))
    try:
        _answer(engine, _chat(engine, ASK), 24)
        assert _answer(engine, prompt, 24)[0] == answer
    finally:
        engine.close()


def test_a_hybrid_model_drafts_with_a_dense_draft_and_answers_as_without(models, tmp_path):
    """A hybrid target's recurrent state is rolled back to the last accepted draft token (per-position
    checkpoints), so a draft model serves it as it serves a dense one; the draft itself must not be hybrid."""
    from tests.hybrid_fixtures import write_tiny_hybrid

    target = write_tiny_hybrid(tmp_path, "lfm2")
    answers = []
    for spec in ("off", "draft"):
        engine = Engine.from_config(EngineConfig(model=target, ctx_size=256, spec=spec,
                                                 model_draft=models["target"] if spec == "draft" else ""))
        try:
            assert not engine.scheduler.speculation.declined
            assert (engine.draft is not None) == (spec == "draft")
            answers.append(_answer(engine, _chat(engine, "one two three " * 10), 12)[0])
            assert (engine.stats.counters["spec_drafted_tokens"] > 0) == (spec == "draft")
        finally:
            engine.close()
    assert answers[0] == answers[1] and len(answers[0]) == 12


def test_a_draft_whose_context_holds_one_token_starts_and_never_drafts(models, tmp_path):
    """Its warm-up has no prompt to run (a context of 1): the engine starts, answers as without, drafts nothing."""
    draft = write_truncated(models["target"], tmp_path / "draft", 2)
    config_file = Path(draft) / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "max_position_embeddings": 1}))
    engine = Engine.from_config(EngineConfig(model=models["target"], ctx_size=512, cpu_weights="float",
                                             spec="draft", model_draft=draft))
    try:
        assert _answer(engine, _chat(engine, "one two three"), 8)[0]
        assert engine.call(lambda: engine.stats.counters["spec_drafted_tokens"]).result() == 0
    finally:
        engine.close()
