"""A, B, A: a conversation restored from the cache is byte- and token-identical to one that never left its slot.

Runs tools/conversation_cache_parity.py in-process: every scenario (shared system prompt, an edited earlier
turn, two slots, budget pressure) in every storage mode on a tiny random-weight model, and the basic and edited
scenarios on the bundled SmolLM2 model. The restart sequence (A, B, A2; a new engine on the same folder: B, A2
with all of its prompt reused) runs on the bundled model in disk and tiered storage and from a two-stage split
onto one stage, int4 weights here (tiered in the slow tier) and float weights in the slow tier: before a prompt's last token was computed
in a step of its own, the second engine's answer differed from the first's.
"""

from __future__ import annotations

import pytest

from tests.model_fixtures import write_tiny_model
from tools.conversation_cache_parity import SCENARIOS, run_scenario


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("parity"), "llama")


def _base(model: str, storage: str) -> dict:
    return {"model": model, "devices": "cpu", "ctx_size": 2048, "conversation_cache_storage": storage,
            "conversation_cache_min_free_mib": 0}


@pytest.mark.parametrize("storage", ["ram", "disk", "tiered"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_restored_conversation_matches_one_that_never_left(tiny_model, storage, scenario):
    outcome = run_scenario(scenario, _base(tiny_model, storage), n_words=60, max_tokens=12)
    assert outcome.passed, outcome.detail


@pytest.mark.parametrize("scenario", ["basic", "edited"])
def test_parity_on_the_bundled_model(scenario):
    outcome = run_scenario(scenario, _base("", "ram"), n_words=120, max_tokens=12)
    assert outcome.passed, outcome.detail


@pytest.mark.parametrize("storage", ["ram", "disk", "tiered"])
def test_parity_on_a_two_stage_cpu_split(tiny_model, storage):
    base = {**_base(tiny_model, storage), "devices": "cpu,cpu", "layer_split": "1,2"}
    outcome = run_scenario("basic", base, n_words=60, max_tokens=12)
    assert outcome.passed, outcome.detail


@pytest.mark.parametrize("other", [{"devices": "cpu", "layer_split": ""}, {"devices": "cpu,cpu", "layer_split": "2,1"}])
def test_conversation_parked_on_a_split_resumes_on_one_device_and_on_another_split(tiny_model, other):
    from tools.conversation_cache_parity import run_resplit

    base = {**_base(tiny_model, "disk"), "devices": "cpu,cpu", "layer_split": "1,2"}
    outcome = run_resplit(base, other, n_words=60, max_tokens=12)
    assert outcome.passed, outcome.detail


def _restart_base(storage: str, weights: str, **layout) -> dict:
    return {**_base("", storage), "cpu_weights": weights, "devices": "cpu", "layer_split": "", **layout}


@pytest.mark.parametrize("storage", ["disk", pytest.param("tiered", marks=pytest.mark.slow)])
def test_restart_continues_the_first_engines_answer_int4(storage):
    """A, B, A2; restart; B, A2 (all of its prompt reused) on the bundled model with int4 weights (the CPU
    default): the same answer and byte-identical slot rows, the recomputed last prompt token included."""
    from tools.conversation_cache_parity import run_restart

    outcome = run_restart(_restart_base(storage, "int4"), {}, n_words=120, max_tokens=8)
    assert outcome.passed, outcome.detail


def test_split_conversation_resumes_on_one_stage_as_it_would_have_continued_int4():
    from tools.conversation_cache_parity import run_restart

    base = _restart_base("disk", "int4", devices="cpu,cpu", layer_split="15,15")
    outcome = run_restart(base, {"devices": "cpu", "layer_split": ""}, n_words=120, max_tokens=8)
    assert outcome.passed, outcome.detail


@pytest.mark.slow
@pytest.mark.parametrize("storage", ["disk", "tiered"])
def test_restart_continues_the_first_engines_answer_float(storage):
    from tools.conversation_cache_parity import run_restart

    outcome = run_restart(_restart_base(storage, "float"), {}, n_words=120, max_tokens=8)
    assert outcome.passed, outcome.detail


@pytest.mark.slow
def test_split_conversation_resumes_on_one_stage_float():
    from tools.conversation_cache_parity import run_restart

    base = _restart_base("disk", "float", devices="cpu,cpu", layer_split="15,15")
    outcome = run_restart(base, {"devices": "cpu", "layer_split": ""}, n_words=120, max_tokens=8)
    assert outcome.passed, outcome.detail


def test_a_prompts_last_token_is_computed_in_a_step_of_its_own():
    from engine.runtime.scheduler import _prefill_end

    def chunks(start, n, chunk):
        out, pos = [], start
        while pos < n:
            end = _prefill_end(pos, n, chunk)
            out.append((pos, end))
            pos = end
        return out

    assert chunks(0, 1, 16) == [(0, 1)]
    assert chunks(0, 10, 16) == [(0, 9), (9, 10)]
    assert chunks(0, 33, 16) == [(0, 16), (16, 32), (32, 33)]
    assert chunks(5, 21, 16) == [(5, 20), (20, 21)]
    assert chunks(20, 21, 16) == [(20, 21)]


def test_restart_sequence_on_a_tiny_model(tiny_model):
    from tools.conversation_cache_parity import run_restart

    outcome = run_restart(_base(tiny_model, "disk"), {}, n_words=60, max_tokens=12)
    assert outcome.passed, outcome.detail
