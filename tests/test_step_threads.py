"""CPU threads per step (engine/runtime/threads.py): prefill on --threads, decode on --decode-threads, and the
kernels give a row the same bits whatever the thread count, so the switch never changes an answer."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.kv import KVBuffers, KVLayout
from engine.model import SeqChunk, load_model, plan_stages
from engine.model.loader import read_model_config
from engine.runtime.engine import Engine
from engine.runtime.requests import GenerationRequest, SamplingParams
from tests.model_fixtures import write_tiny_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("threads"), "llama", hidden_size=256, intermediate_size=512)


def test_prefill_steps_run_on_the_compute_threads_and_decode_steps_on_the_decode_threads(tiny_model):
    engine = Engine.from_config(EngineConfig(model=tiny_model, threads=2, decode_threads=1, conversation_cache_mib=0,
                                             prefill_chunk=16))
    seen: set[tuple[bool, int]] = set()  # (every row one token, torch's threads in that step)
    forward = engine.model.forward_chunks

    def observed(chunks, *args, **kwargs):
        seen.add((all(ch.tokens.numel() == 1 for ch in chunks), torch.get_num_threads()))
        return forward(chunks, *args, **kwargs)

    engine.model.forward_chunks = observed
    try:
        prompt = engine.tokenizer.encode("a lighthouse keeper counts the ships that pass in the night " * 3)
        events = list(engine.submit(GenerationRequest("t", prompt, SamplingParams(temperature=0.0, max_tokens=6,
                                                                                 ignore_eos=True))))
        assert sum(e.token_id is not None for e in events) == 6
        metrics = engine.stats_snapshot()["engine"]  # an EngineFigures
    finally:
        engine.close()
    assert seen == {(False, 2), (True, 1)}
    assert (metrics.threads, metrics.decode_threads) == (2, 1)


@pytest.mark.parametrize("int4_weights", [True, False])
def test_prefill_and_decode_rows_are_the_same_bits_on_one_thread_and_on_two(tiny_model, int4_weights):
    lm = load_model(tiny_model, plan_stages(read_model_config(tiny_model).n_layers, "cpu", ""), torch.float32,
                    int4_weights=int4_weights)
    c = lm.config
    ids = torch.randint(0, c.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    runs = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            kv = KVBuffers(KVLayout(c.n_layers, c.n_kv_heads, c.head_dim, lm.dtype), 1, 64, lm.model.stages)
            with torch.inference_mode():
                rows = [lm.model.forward_chunks([SeqChunk(0, 0, ids)], kv, all_logits=True)[0]]
                rows += [lm.model.forward_chunks([SeqChunk(0, 40 + i, ids[i : i + 1])], kv)[0] for i in range(6)]
            runs.append(rows)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def _feed(probe, rows: int, seconds_by_threads: dict[int, float], steps: int) -> list[int]:
    """Run `steps` decode steps through the probe, each taking seconds_by_threads[its count]; the counts used."""
    used = []
    for _ in range(steps):
        threads = probe.threads()
        used.append(threads)
        probe.record(rows, seconds_by_threads[threads])
    return used


def test_the_decode_thread_count_follows_whichever_measures_faster():
    from engine.runtime.threads import DecodeThreadsProbe

    probe = DecodeThreadsProbe(compute=4, start=1)
    first, period, probe_steps = DecodeThreadsProbe.FIRST, DecodeThreadsProbe.PERIOD, DecodeThreadsProbe.PROBE
    # a quiet machine: four threads take half the time of one; after the first few steps, a probe, then four it is
    used = _feed(probe, 1, {1: 0.010, 4: 0.005}, first + probe_steps)
    assert used == [1] * first + [4] * probe_steps and probe.current == 4 and probe.switches == 1
    assert _feed(probe, 1, {1: 0.010, 4: 0.005}, period) == [4] * period  # then a period before the next probe
    # the next probe, of one thread, is slower: four stay
    assert _feed(probe, 1, {1: 0.010, 4: 0.005}, probe_steps) == [1] * probe_steps
    assert probe.current == 4 and probe.switches == 1
    # another program takes a core: four threads wait for it, one does not; back to one
    _feed(probe, 1, {1: 0.011, 4: 0.050}, period + probe_steps)
    assert probe.current == 1 and probe.switches == 2
    # within MARGIN (a few % faster) is not a reason to switch
    _feed(probe, 1, {1: 0.0100, 4: 0.0097}, period + probe_steps)
    assert probe.current == 1
    # steps of another row count than the probe's are not compared
    before = probe.switches
    _feed(probe, 2, {1: 0.010, 4: 0.001}, period)
    _feed(probe, 3, {1: 0.010, 4: 0.001}, probe_steps)
    assert probe.switches == before and probe.current == 1


def test_with_decode_threads_0_the_engine_times_its_decode_threads_and_answers_the_same(tiny_model):
    prompt_text = "a lighthouse keeper counts the ships that pass in the night " * 3
    answers, probes = [], []
    for decode_threads in (0, 1):
        engine = Engine.from_config(EngineConfig(model=tiny_model, threads=2, decode_threads=decode_threads,
                                                 conversation_cache_mib=0))
        try:
            probes.append(engine.step_threads.probe)
            prompt = engine.tokenizer.encode(prompt_text)
            request = GenerationRequest("t", prompt, SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True))
            answers.append([e.token_id for e in engine.submit(request) if e.token_id is not None])
        finally:
            engine.close()
    assert probes[0] is not None and probes[1] is None  # a fixed --decode-threads is kept as given
    assert probes[0].threads() in (1, 2)
    assert len(answers[0]) == 80 and answers[0] == answers[1]  # whatever counts it ran on, the same tokens
