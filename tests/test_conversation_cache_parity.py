"""A, B, A: a conversation restored from the cache is byte- and token-identical to one that never left its slot.

Runs tools/conversation_cache_parity.py in-process: every scenario (shared system prompt, an edited earlier
turn, two slots, budget pressure) in every storage mode on a tiny random-weight model, and the basic and edited
scenarios on the bundled SmolLM2 model.
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
