"""Gemma 4 (text) in the conversation cache: a parked conversation (global layer every row, local layers their
last window) restored in ram, disk and tiered storage, and after a restart, is byte-identical and continues
token for token (tools/conversation_cache_parity.py on the tiny model of tests/test_gemma4.py)."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.runtime.engine import Engine
from tests.model_fixtures import write_tiny_model
from tests.test_gemma4 import SHARED
from tools.conversation_cache_parity import SCENARIOS, run_restart, run_scenario

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return write_tiny_model(tmp_path_factory.mktemp("gemma4-parking"), "gemma4")


@pytest.fixture(scope="module")
def shared_model(tmp_path_factory) -> str:
    return write_tiny_model(tmp_path_factory.mktemp("gemma4-shared-parking"), "gemma4", **SHARED)


def _base(model: str, storage: str) -> dict:
    return {"model": model, "devices": "cpu", "ctx_size": 2048, "conversation_cache_storage": storage,
            "conversation_cache_min_free_mib": 0, "conversation_cache_block_tokens": 16}


# ram and a restart from tiered storage in the quick suite; the rest (a few seconds each) marked slow.
@pytest.mark.parametrize("storage", ["ram", pytest.param("disk", marks=pytest.mark.slow),
                                     pytest.param("tiered", marks=pytest.mark.slow)])
def test_parked_conversation_continues_as_if_it_never_left(model, storage):
    outcome = run_scenario("basic", _base(model, storage), n_words=60, max_tokens=12)
    assert outcome.passed, outcome.detail


@pytest.mark.slow
@pytest.mark.parametrize("storage", ["ram", "disk", "tiered"])
@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if s != "basic"])
def test_every_parity_scenario_passes(model, storage, scenario):
    outcome = run_scenario(scenario, _base(model, storage), n_words=60, max_tokens=12)
    assert outcome.passed, outcome.detail
    if scenario == "edited":  # a change before the parked window prefills, with the reason said
        assert "reason window" in outcome.detail


@pytest.mark.parametrize("storage", [pytest.param("disk", marks=pytest.mark.slow), "tiered"])
def test_restart_resumes_the_parked_conversation(model, storage):
    outcome = run_restart(_base(model, storage), {}, n_words=60, max_tokens=8)
    assert outcome.passed, outcome.detail


@pytest.mark.parametrize("storage", ["ram", pytest.param("tiered", marks=pytest.mark.slow)])
def test_layers_sharing_k_v_are_not_parked_and_the_rest_restores_exactly(shared_model, storage):
    """Two of six layers read earlier layers' K/V: the slots, and so every parked block and window, hold the
    four layers before them; a parked conversation still continues token for token."""
    engine = Engine.from_config(EngineConfig(**_base(shared_model, storage)))
    try:
        assert engine.layout.n_layers == 4 and engine.cache_identity.local_layers == (0, 1, 3)
    finally:
        engine.close()
    outcome = run_scenario("basic", _base(shared_model, storage), n_words=60, max_tokens=12)
    assert outcome.passed, outcome.detail


@pytest.mark.slow
def test_layers_sharing_k_v_resume_after_a_restart(shared_model):
    outcome = run_restart(_base(shared_model, "disk"), {}, n_words=60, max_tokens=8)
    assert outcome.passed, outcome.detail
