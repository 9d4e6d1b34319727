"""Speculative decoding by prompt lookup (`--spec prompt-lookup`): the drafts, their length, and greedy output
token-identical with and without speculation (bundled model, tiny random models: dense, sliding-window and
mixture-of-experts; two slots at once, a parked conversation restored)."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.runtime.answer_memory import BOUNDARY, AnswerMemory
from engine.runtime.engine import Engine
from engine.runtime.requests import GenerationRequest, SamplingParams
from engine.runtime.speculation import BACKOFF_FIRST, MATCH_MAX, MIN_RATE, Drafter, Length, lookup
from engine.runtime.step_costs import HIGHEST, StepCosts
from engine.setting import SettingError
from tests.hybrid_fixtures import write_tiny_hybrid
from tests.model_fixtures import write_tiny_model
from tests.moe_fixtures import write_tiny_moe_model

CODE = """def parse_header(line):
    name, _, value = line.partition(":")
    if not name or not value:
        raise ValueError(f"bad header line: {line!r}")
    return name.strip().lower(), value.strip()


def read_headers(lines):
    headers = {}
    for line in lines:
        if not line.strip():
            break
        name, value = parse_header(line)
        headers[name] = value
    return headers
"""
ASK = "Here is a file:\n\n" + CODE + "\nRepeat the file exactly, with `headers` renamed to `fields`."


def _index(tokens: list[int]) -> dict[int, list[int]]:
    at: dict[int, list[int]] = {}
    for i, t in enumerate(tokens):
        at.setdefault(t, []).append(i)
    return at


def test_lookup_takes_the_longest_suffix_then_the_most_recent_occurrence():
    tokens = [1, 2, 3, 10, 11, 9, 2, 3, 20, 21, 1, 2, 3]
    # "1 2 3" occurred at 0..2 (followed by 10 11); "2 3" more recently at 6..7 (followed by 20): longest wins
    assert lookup(tokens, _index(tokens), 2) == [10, 11]
    tokens = [5, 2, 3, 10, 11, 7, 2, 3, 20, 21, 8, 2, 3]
    assert lookup(tokens, _index(tokens), 3) == [20, 21, 8]  # a tie on "2 3": the more recent
    tokens = [1, 2, 3, 4, 5, 6]
    assert lookup(tokens, _index(tokens), 4) == []  # no suffix of two tokens occurred before
    tokens = [4, 4, 4, 4]
    assert lookup(tokens, _index(tokens), 4) == [4]  # the continuation stops at the end of what is known


def test_lookup_takes_the_longer_context_from_the_recent_answers_and_a_tie_from_the_conversation():
    memory = AnswerMemory()
    memory.add([9, 1], [2, 3, 40, 41], memory.epoch)  # an earlier answer: "9 1 2 3" was followed by 40 41
    tokens = [5, 2, 3, 10, 11, 9, 1, 2, 3]  # the conversation's "2 3" was followed by 10 11
    assert lookup(tokens, _index(tokens), 2, memory) == [40, 41]  # "9 1 2 3" matches longer than "5 2 3"
    tokens = [9, 1, 2, 3, 10, 11, 9, 1, 2, 3]
    assert lookup(tokens, _index(tokens), 2, memory) == [10, 11]  # "9 1 2 3" in both: the conversation's own
    memory.add([], [3, 2, 3], memory.epoch)
    tokens = [7, 9, 1, 2, 3]
    # the newest answer's "2 3" ends its entry: a shorter match, and no draft runs across into the next entry
    assert lookup(tokens, _index(tokens), 4, memory) == [40, 41]
    memory = AnswerMemory()
    memory.add([1, 2], [3], memory.epoch)  # "1 2 3" with nothing after it: no match, so the conversation's own "2 3" drafts
    tokens = [2, 3, 7, 8, 1, 2, 3]
    assert lookup(tokens, _index(tokens), 4, memory) == [7, 8, 1, 2]


def test_the_recent_answers_are_bounded_and_forget_the_oldest_first():
    memory = AnswerMemory(capacity=32)
    for i in range(10):
        memory.add([100 + i], [200 + i, 300 + i, 400 + i], memory.epoch)
    assert len(memory.tokens) <= 32 and memory.tokens[-1] == BOUNDARY
    assert memory.places(200) == [] and memory.places(209) != []  # the oldest went first
    found = memory.places(209)[0]
    assert memory.after(found, 8) == [309, 409]  # stops at its entry's end
    memory.add([1] * 100, [2] * 100, memory.epoch)  # one entry past the capacity keeps its newest tokens
    assert memory.tokens == [2] * 23 + [BOUNDARY]
    memory.clear()
    assert memory.tokens == [] and memory.places(2) == []


def test_a_finished_request_leaves_its_answer_behind_its_prompts_tail():
    memory = AnswerMemory()
    prompt = list(range(1000, 1000 + MATCH_MAX + 8))
    drafter = Drafter(prompt, 8, memory=memory)
    drafter.finish([7, 8, 9])
    assert memory.tokens == [*prompt[-MATCH_MAX:], 7, 8, 9, BOUNDARY]
    again = Drafter(prompt, 8, memory=memory)  # the same request again drafts its answer at once
    assert again.draft([], room=8) == [7, 8, 9]
    running = Drafter(prompt, 8, memory=memory)
    memory.clear()  # a purge or a dropped conversation while `running` decodes: its answer is not kept either
    running.finish([7, 8, 9])
    assert memory.tokens == []
    Drafter(prompt, 8, memory=memory).finish([7, 8, 9])  # a request begun after it is
    assert memory.tokens[-4:] == [7, 8, 9, BOUNDARY]


def test_drafter_reads_prompt_and_generated_tokens():
    drafter = Drafter([7, 8, 9, 1, 2, 3], draft_max=8)
    assert drafter.draft([7, 8], room=8) == [9, 1, 2, 3][:4]  # first draft: FIRST_LENGTH tokens
    assert drafter.draft([7, 8, 9, 1, 2], room=1) == [3]  # never past the room left


def test_the_break_even_is_a_rows_cost_over_a_steps_fitted_from_the_steps_seen():
    costs = StepCosts(fallback=MIN_RATE)
    for _ in range(40):
        costs.note(1, 0.010)
    assert costs.line() is None and costs.break_even() == MIN_RATE  # one row count fits no line
    costs.note(5, 0.022)
    assert costs.line() is None  # nor does one step of another (a busy machine moves a step by a quarter)
    for _ in range(20):
        costs.note(3, 0.016)
    base, per_row = costs.line()
    assert base == pytest.approx(0.010) and per_row == pytest.approx(0.003)
    assert costs.break_even() == pytest.approx(0.3)
    # The machine or the model changes (experts: each extra row reads other experts): old steps fade.
    for _ in range(3000):
        costs.note(1, 0.010)
        costs.note(2, 0.018)
    assert costs.break_even() == pytest.approx(0.8, abs=0.01)
    for _ in range(3000):
        costs.note(1, 0.010)
        costs.note(2, 0.030)
    assert costs.break_even() == HIGHEST  # never "nothing could pay": a probe still runs after each pause
    # Several slots decoding at once: a draft row must pay for its share of the whole step's tokens.
    costs = StepCosts(fallback=MIN_RATE)
    for _ in range(3000):
        costs.note(4, 0.0087 + 3 * 0.00365, slots=4)
        costs.note(5, 0.0087 + 4 * 0.00365, slots=4)
    assert costs.break_even() == pytest.approx(4 * 0.00365 / (0.0087 + 3 * 0.00365), abs=0.01)  # ~0.74
    costs.note(1, 0.0087)
    assert costs.break_even() == pytest.approx(0.00365 / 0.0087, abs=0.01)  # ~0.42 with one slot decoding


def test_the_draft_length_pauses_below_the_measured_break_even_and_counts_decided_positions():
    for break_even, pauses in ((0.5, False), (0.8, True)):  # 3 of 8 drafted (0.375) would pause at 0.5
        length = Length(draft_max=8, break_even=lambda b=break_even: b)
        for _ in range(6):  # 3 of each 8 drafted kept: 3 of 4 decided positions (the 5th rejected, then unjudged)
            length.current = 8
            length.record(8, 3)
        assert length.rate == pytest.approx(0.75, abs=0.05) or pauses, length.rate
        assert bool(length.skip) == pauses, (break_even, length)


def test_draft_length_grows_on_full_acceptance_and_pauses_when_it_does_not_pay():
    length = Length(draft_max=8)
    assert length.want() == 4
    length.record(4, 4)
    assert length.want() == 8
    length.record(8, 8)
    assert length.want() == 8  # capped at --spec-draft-max
    length.record(8, 2)
    assert length.want() == 3  # what was accepted, plus one
    for _ in range(3):
        length.record(3, 0)
        if length.skip:
            break
    assert length.skip == BACKOFF_FIRST
    assert [length.want() for _ in range(BACKOFF_FIRST)] == [0] * BACKOFF_FIRST
    assert length.want() == 1  # then one probe


def test_bad_draft_max_is_refused_with_the_expectation():
    with pytest.raises(SettingError, match="--spec-draft-max"):
        EngineConfig(spec_draft_max=0)
    with pytest.raises(SettingError, match="--spec"):
        EngineConfig(spec="ngram")


def _chat(engine: Engine, text: str) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.render_chat([{"role": "user", "content": text}]), add_special_tokens=False)


def _answer(engine: Engine, prompt: list[int], max_tokens: int) -> tuple[list[int], int]:
    """A greedy answer's tokens and the prompt tokens it reused."""
    tokens, cached = [], 0
    for event in _submit(engine, prompt, max_tokens):
        assert event.error is None, event.error
        if event.token_id is not None:
            tokens.append(event.token_id)
        if event.usage is not None:
            cached = event.usage.cached_tokens
    return tokens, cached


def _submit(engine: Engine, prompt: list[int], max_tokens: int):
    return engine.submit(GenerationRequest(f"spec-{len(prompt)}-{max_tokens}", prompt,
                                           SamplingParams(temperature=0.0, max_tokens=max_tokens)))


def _accepted(engine: Engine) -> int:
    return engine.call(lambda: engine.stats.counters["spec_accepted_tokens"]).result()


def _run(config: EngineConfig, asks: list[str], max_tokens: int) -> tuple[list, dict]:
    """Each ask's greedy answer, one after another, and the engine's counters."""
    engine = Engine.from_config(config)
    try:
        answers = [_answer(engine, _chat(engine, ask), max_tokens)[0] for ask in asks]
        return answers, dict(engine.stats.counters)
    finally:
        engine.close()


def _same_with_and_without(config: EngineConfig, asks: list[str], max_tokens: int) -> None:
    off, _ = _run(config, asks, max_tokens)
    on, counters = _run(config.replace(spec="prompt-lookup"), asks, max_tokens)
    assert on == off
    assert counters["spec_accepted_tokens"] > 0, counters


@pytest.fixture(scope="module")
def bundled():
    """The bundled model without and with speculation: two slots, parked conversations kept in RAM."""
    base = EngineConfig(ctx_size=1024, parallel=2, conversation_cache_storage="ram",
                        conversation_cache_min_free_mib=0)
    engines = {"off": Engine.from_config(base), "on": Engine.from_config(base.replace(spec="prompt-lookup"))}
    yield engines
    for engine in engines.values():
        engine.close()


def test_bundled_model_answers_token_identical_with_prompt_lookup(bundled):
    answers = {k: _answer(e, _chat(e, ASK), 80)[0] for k, e in bundled.items()}
    assert answers["on"] == answers["off"]
    assert _accepted(bundled["on"]) > 0
    # Its decode steps, one row and a draft's several, measured what a row costs here (the break-even's line).
    engine = bundled["on"]
    base, per_row = engine.call(engine.scheduler.speculation.costs.line).result()
    assert base > 0 and per_row > 0, (base, per_row)
    shown = {k: e.call(e.engine_stats).result().spec_break_even for k, e in bundled.items()}  # GET /metrics
    assert shown["off"] is None and shown["on"] == pytest.approx(min(0.95, max(0.05, per_row / base))), shown


def test_a_repeated_request_drafts_from_the_earlier_answer_and_a_purge_forgets_it(bundled):
    engine = bundled["on"]
    ask = ASK.replace("`fields`", "`lines_read`")
    records = []
    for _ in range(2):
        answer, _ = _answer(engine, _chat(engine, ask), 60)
        records.append(_records(engine)[-1])
    assert answer == _answer(bundled["off"], _chat(engine, ask), 60)[0]
    # the second answer's drafts came from the first, whole: more of them accepted
    assert records[1].spec_accepted > records[0].spec_accepted, records
    memory = engine.scheduler.speculation.memory
    assert engine.call(lambda: len(memory.tokens)).result() > 0
    engine.call(lambda: engine.purge_cache("disk")).result()  # any purge
    assert engine.call(lambda: len(memory.tokens)).result() == 0


def test_a_seeded_sampled_answer_is_the_same_with_and_without_drafts_from_recent_answers(bundled):
    params = SamplingParams(temperature=0.7, seed=1, max_tokens=40)
    ask = ASK.replace("`fields`", "`seen`")
    answers = []
    for engine in (bundled["on"], bundled["on"], bundled["off"]):  # the second drafts from the first's answer
        events = list(engine.submit(GenerationRequest("spec-seeded", _chat(engine, ask), params)))
        answers.append([e.token_id for e in events if e.token_id is not None])
    assert answers[0] == answers[1] == answers[2]
    assert _records(bundled["on"])[-1].spec_drafted > 0


def _records(engine: Engine):
    return engine.call(engine.stats.requests.snapshot).result()


def test_stop_strings_end_the_answer_where_they_do_without_speculation(bundled):
    texts = {}
    for key, engine in bundled.items():
        prompt = _chat(engine, ASK)
        params = SamplingParams(temperature=0.0, max_tokens=120, stop=["def read_headers"])
        events = list(engine.submit(GenerationRequest(f"spec-stop-{key}", prompt, params)))
        assert events[-1].stop_string == "def read_headers", events[-1]
        texts[key] = ("".join(e.text for e in events), [e.token_id for e in events if e.token_id is not None])
    assert texts["on"] == texts["off"]
    record = _records(bundled["on"])[-1]
    assert record.spec_accepted > 0 and record.spec_drafted >= record.spec_accepted  # per request in the log


def test_a_requests_figures_count_every_verify_its_last_too(bundled):
    """A request that ends in a verify (max_tokens reached on its last row) has it in its record."""
    engine = bundled["on"]

    def counters() -> tuple[int, int]:
        c = engine.stats.counters
        return c["spec_drafted_tokens"], c["spec_accepted_tokens"]

    for max_tokens in (13, 48):
        drafted, accepted = engine.call(counters).result()
        _answer(engine, _chat(engine, ASK.replace("`fields`", f"`f{max_tokens}`")), max_tokens)
        now_drafted, now_accepted = engine.call(counters).result()
        record = _records(engine)[-1]
        assert (record.spec_drafted, record.spec_accepted) == (now_drafted - drafted, now_accepted - accepted) != (0, 0)


def test_sampled_requests_are_speculated(bundled):
    """A sampled request drafts and keeps some drafts (its distribution: tests/test_spec_sampling.py)."""
    engine = bundled["on"]
    before = engine.call(lambda: engine.stats.counters["spec_drafted_tokens"]).result()
    params = SamplingParams(temperature=0.3, seed=1, max_tokens=30)
    events = list(engine.submit(GenerationRequest("spec-sampled", _chat(engine, ASK), params)))
    assert events[-1].usage.completion_tokens == 30
    assert engine.call(lambda: engine.stats.counters["spec_drafted_tokens"]).result() > before
    record = _records(engine)[-1]
    assert record.spec_drafted > 0 and 0 <= record.spec_accepted <= record.spec_drafted


def test_two_slots_speculate_in_one_step(bundled):
    asks = [ASK.replace("`fields`", "`entries`"), ASK.replace("renamed to `fields`", "unchanged")]
    answers = {}
    for key, engine in bundled.items():
        before = _accepted(engine)
        streams = [_submit(engine, _chat(engine, ask), 40) for ask in asks]  # both decode in the same steps
        answers[key] = [[e.token_id for e in s if e.token_id is not None] for s in streams]
        if key == "on":
            assert _accepted(engine) > before
    assert answers["on"] == answers["off"]


def _switch_back(engine: Engine) -> tuple[list[int], int]:
    """A's turn, then B's and C's (parking A from its slot), then A's next turn restored: that answer and the
    prompt tokens it reused."""
    first, _ = _answer(engine, _chat(engine, ASK), 30)
    for topic in ("rivers", "towns"):  # longer than A: each displaces the slot whose loss is cheapest, A's last
        _answer(engine, _chat(engine, f"Summarise this list of {topic}: " + ", ".join(f"{topic} {i}"
                                                                                      for i in range(70))), 8)
    tok = engine.tokenizer
    turn = [{"role": "user", "content": ASK}, {"role": "assistant", "content": tok.decode(first)},
            {"role": "user", "content": "Now repeat the file once more, unchanged."}]
    return _answer(engine, tok.encode(tok.render_chat(turn), add_special_tokens=False), 50)


def test_restored_conversation_continues_identically_with_prompt_lookup(bundled):
    off, cached_off = _switch_back(bundled["off"])
    before = _accepted(bundled["on"])
    on, cached_on = _switch_back(bundled["on"])
    assert cached_on == cached_off > 0
    for engine in bundled.values():  # restored from the cache, not continued in a live slot
        assert engine.call(lambda e=engine: e.stats.requests.snapshot()[-1].source).result() == "ram"
    assert on == off
    assert _accepted(bundled["on"]) > before


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    # Small initial weights: a random model that falls into loops, which its own tokens then predict.
    root = tmp_path_factory.mktemp("spec")
    return {"llama": write_tiny_model(root, "llama", initializer_range=0.01),
            "sliding": write_tiny_model(root / "sliding", "qwen2", initializer_range=0.01, use_sliding_window=True,
                                        sliding_window=8, max_window_layers=1),
            "moe": write_tiny_moe_model(root / "moe", "mixtral", initializer_range=0.01)}


LOOPING = ["one two three " * 20, "alpha beta " * 30]


@pytest.mark.parametrize("model", ["llama", "sliding", "moe"])
def test_tiny_random_model_answers_token_identical(tiny_models, model):
    _same_with_and_without(EngineConfig(model=tiny_models[model], ctx_size=512, cpu_weights="float"), LOOPING, 48)


def test_tiny_random_model_with_4_bit_weights_answers_token_identical(tiny_models, kernel):
    _same_with_and_without(EngineConfig(model=tiny_models["llama"], ctx_size=512, cpu_weights="int4"), LOOPING, 48)


def test_sampled_request_whose_nucleus_is_one_token_answers_token_identical(tiny_models):
    """top_p 0 leaves one token to draw from: a sampled request (rejection sampling, penalties on the rows in
    order) that must give the same tokens with and without drafts."""
    config = EngineConfig(model=tiny_models["llama"], ctx_size=512, cpu_weights="float")
    params = SamplingParams(temperature=0.9, top_p=0.0, repeat_penalty=1.1, repeat_last_n=4, seed=3,
                            max_tokens=48)
    answers = {}
    for method in ("off", "prompt-lookup"):
        engine = Engine.from_config(config.replace(spec=method))
        try:
            answers[method] = [[e.token_id for e in engine.submit(GenerationRequest(f"nucleus-{i}",
                                                                                   _chat(engine, ask), params))
                                if e.token_id is not None] for i, ask in enumerate(LOOPING)]
            if method != "off":
                assert _accepted(engine) > 0
        finally:
            engine.close()
    assert answers["prompt-lookup"] == answers["off"]


HYBRIDS = {"lfm2": 0.1, "qwen3_5": 0.02, "nemotron_h": 0.1}  # short conv; DeltaNet; Mamba-2 (initial weights)


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec-hybrid")
    return {arch: write_tiny_hybrid(root, arch, overrides={"initializer_range": ir, "max_position_embeddings": 4096})
            for arch, ir in HYBRIDS.items()}


@pytest.mark.parametrize("arch", list(HYBRIDS))
def test_hybrid_model_answers_token_identical(hybrids, arch):
    """The recurrent state is rolled back to the last accepted draft token (the state kept after each drafted
    row): rejected drafts included, the answers are those of decoding without drafts."""
    config = EngineConfig(model=hybrids[arch], ctx_size=512)
    off, _ = _run(config, LOOPING, 48)
    on, counters = _run(config.replace(spec="prompt-lookup"), LOOPING, 48)
    assert on == off
    assert 0 < counters["spec_accepted_tokens"] < counters["spec_drafted_tokens"], counters  # some rejected


def test_hybrid_restored_conversation_continues_identically(hybrids):
    """A conversation parked in RAM and restored (its recurrent state from a checkpoint) goes on drafting; a
    checkpoint every 16 tokens falls among drafted rows too (kept when accepted, dropped when rejected)."""
    base = EngineConfig(model=hybrids["qwen3_5"], ctx_size=4096, parallel=2, conversation_cache_storage="ram",
                        conversation_cache_min_free_mib=0, conversation_cache_block_tokens=16,
                        conversation_cache_checkpoint_tokens=16)
    answers = {}
    for method in ("off", "prompt-lookup"):
        engine = Engine.from_config(base.replace(spec=method))
        try:
            before = _accepted(engine)
            answers[method] = _switch_back(engine)
            assert engine.call(lambda e=engine: e.stats.requests.snapshot()[-1].source).result() == "ram"
            if method != "off":
                assert _accepted(engine) > before
        finally:
            engine.close()
    assert answers["prompt-lookup"] == answers["off"] and answers["off"][1] > 0


@pytest.mark.parametrize("arch", ["qwen3_5", "nemotron_h"])
def test_a_hybrid_slots_draft_rows_compute_what_decoding_them_one_by_one_does(hybrids, arch):
    """One forward with a slot's four one-token rows (beside another slot's row) gives each row the logits,
    and each drafted position the recurrent state, of decoding the tokens one step at a time: bit for bit."""
    from engine.model.llama import SeqChunk

    engine = Engine.from_config(EngineConfig(model=hybrids[arch], ctx_size=256, parallel=3))
    try:
        model, kv, state = engine.model, engine.kv, engine.memory.states.buffers
        prompt, drafted = torch.arange(3, 40), [7, 11, 13, 17]

        def rows(slot: int, tokens: list[int]) -> list[SeqChunk]:
            at = state.positions[slot]
            return [SeqChunk(slot, at + j, torch.tensor([t])) for j, t in enumerate(tokens)]

        for slot in range(3):
            model.forward_chunks([SeqChunk(slot, 0, prompt)], kv, state)
        one_by_one, states = [], {}
        for t in drafted:
            one_by_one.append(model.forward_chunks(rows(0, [t]), kv, state)[0])
            states[state.positions[0]] = state.read(0).tensors
        n = len(prompt)
        state.request_checkpoints(1, range(n + 1, n + len(drafted)))
        together = model.forward_chunks(rows(2, [5]) + rows(1, drafted), kv, state)
        assert all(torch.equal(together[1 + j], one_by_one[j]) for j in range(len(drafted)))
        taken = state.take_checkpoints(1)
        assert sorted(taken) == list(range(n + 1, n + len(drafted)))
        for p, snapshot in taken.items():
            assert all(torch.equal(a, b) for a, b in zip(snapshot.tensors, states[p], strict=True)), p
        assert all(torch.equal(a, b) for a, b in zip(state.read(1).tensors, state.read(0).tensors, strict=True))
    finally:
        engine.close()
