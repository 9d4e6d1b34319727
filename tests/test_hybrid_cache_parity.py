"""A, B, A on hybrid models (tiny random LFM2, Granite-4.0-H dense and with experts, Qwen3.5, Nemotron-H dense and
MoE, Falcon-H1): conversation A parked with its recurrent state checkpoints while B runs, then A's next turn, is
token-identical to A alone on a fresh engine, with byte-identical K/V and recurrent state, in ram, disk and tiered
storage (every scenario of the parity tool on one family of each recurrent kind: a shared system prompt, two
slots filled by others, budget pressure); an edited first message resumes from the checkpoint before the edit; after a restart (disk, tiered) the
whole prompt is reused and the answer is the first engine's. Runs tools/conversation_cache_parity.py in-process."""

from __future__ import annotations

import pytest
import torch

from tests.hybrid_fixtures import HYBRID_ARCHS, one_thread, write_tiny_hybrid  # noqa: F401 (fixture)
from tools.conversation_cache_parity import SCENARIOS, run_restart, run_scenario


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hybrid-parity")
    return {arch: write_tiny_hybrid(root, arch) for arch in HYBRID_ARCHS}


def _base(folder: str, storage: str) -> dict:
    # checkpoints every block: the edited scenario's edit comes ~130 tokens in
    return {"model": folder, "devices": "cpu", "ctx_size": 512, "conversation_cache_storage": storage,
            "conversation_cache_min_free_mib": 0, "cpu_weights": "float", "prefill_chunk": 32,
            "conversation_cache_checkpoint_tokens": 64}


STORAGES = ("ram", "disk", "tiered")


# Every scenario of the parity tool on one family of each recurrent kind (short convolution, gated DeltaNet,
# Mamba-2): the scenarios exercise the scheduler and the cache around the slot memory, which is the same for every
# hybrid. Every family runs the basic scenario in each storage (its own state parts parked and restored
# byte-identically), the restart, the re-split and the slot file below.
KINDS = ("lfm2", "qwen3_5", "granitemoehybrid")
CASES = [(scenario, arch) for scenario in SCENARIOS for arch in HYBRID_ARCHS if arch in KINDS or scenario == "basic"]


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize(("scenario", "arch"), CASES)
def test_a_parked_hybrid_conversation_continues_as_if_it_never_left(folders, arch, storage, scenario):
    outcome = run_scenario(scenario, _base(folders[arch], storage), n_words=40, max_tokens=8)
    assert outcome.passed, outcome.detail
    # (under pressure A was evicted and computed again from another start: only its output must be the same)
    assert scenario == "pressure" or "recurrent state byte-identical" in outcome.detail


@pytest.mark.parametrize("storage", ["disk", "tiered"])
@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_a_hybrid_conversation_resumes_after_a_restart_as_the_first_engine_continued(folders, arch, storage):
    outcome = run_restart(_base(folders[arch], storage), {}, n_words=40, max_tokens=8)
    assert outcome.passed, outcome.detail


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_a_hybrid_conversation_parked_on_a_two_stage_split_resumes_on_one_stage_and_on_another_split(folders, arch):
    """Stage 0 holds a recurrent layer only (no K/V at all): each layer's state lives and is parked per stage,
    in a split-independent layout."""
    from tools.conversation_cache_parity import run_resplit

    base = {**_base(folders[arch], "disk"), "devices": "cpu,cpu", "layer_split": "1,3"}
    outcome = run_scenario("basic", base, n_words=40, max_tokens=8)
    assert outcome.passed, outcome.detail
    for other in ({"devices": "cpu", "layer_split": ""}, {"devices": "cpu,cpu", "layer_split": "3,1"}):
        outcome = run_resplit(base, other, n_words=40, max_tokens=8)
        assert outcome.passed, outcome.detail


def test_a_qwen35_gguf_conversation_is_parked_and_resumed_like_its_hf_folder(tmp_path):
    """The same through a GGUF file with llama.cpp's qwen35 names and rewrites."""
    from tests.hybrid_fixtures import write_tiny_hybrid_gguf

    base = _base(write_tiny_hybrid_gguf(tmp_path, "qwen3_5"), "disk")
    for outcome in (run_scenario("edited", base, n_words=40, max_tokens=8),
                    run_restart(base, {}, n_words=40, max_tokens=8)):
        assert outcome.passed, outcome.detail


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_a_hybrid_slot_saved_to_a_file_and_restored_continues_as_if_it_never_left(folders, arch, tmp_path):
    """POST /slots/{id}?action=save|restore on a hybrid model: the file holds the K/V and the recurrent state
    after its tokens; restored into an erased slot, the next turn is the one the slot would have computed."""
    from engine.config import EngineConfig
    from engine.runtime.engine import Engine
    from tools.conversation_cache_parity import _conversation, _generate, _slot_kv, _slot_state, _text

    config = EngineConfig(**{**_base(folders[arch], "ram"), "conversation_cache_mib": 0,
                             "slot_save_path": str(tmp_path)})
    conv = _conversation("You are careful. " + _text(30, 1), "Summarise.", 3)
    answers = []
    for save in (False, True):
        eng = Engine.from_config(config)
        try:
            a1, _, _ = _generate(eng, conv, 8)
            if save:
                tokens, kv = _slot_kv(eng, 0)
                state = _slot_state(eng, 0)
                eng.call(lambda e=eng: e.save_slot(0, "a.slot")).result()
                eng.call(lambda e=eng: e.erase_slot(0)).result()
                eng.call(lambda e=eng: e.restore_slot(0, "a.slot")).result()
                assert _slot_kv(eng, 0)[0] == tokens and torch.equal(_slot_kv(eng, 0)[1], kv)
                assert _slot_state(eng, 0) == state
            turn2 = conv + [{"role": "assistant", "content": a1}, {"role": "user", "content": "More."}]
            answers.append(_generate(eng, turn2, 8)[1:])
        finally:
            eng.close()
    assert answers[1][0] == answers[0][0] and answers[1][1] > 0


def test_decode_takes_a_checkpoint_at_each_block_end_it_crosses(folders):
    """An answer generated past a block end leaves a checkpoint there: when the answer comes back re-rendered
    into other tokens a little past that end, the next turn resumes at the block end instead of re-prefilling
    rows of a block the cache already holds (those would differ from the decoded ones in their last bits; the
    tiny Qwen3.5-MoE's restart scenario above hits exactly that)."""
    from engine.config import EngineConfig
    from engine.runtime.engine import Engine
    from engine.runtime.requests import GenerationRequest, SamplingParams
    from tools.conversation_cache_parity import _conversation

    eng = Engine.from_config(EngineConfig(**{**_base(folders["qwen3_5"], "ram"), "conversation_cache_mib": 0}))
    try:
        conv = _conversation("You are careful.", "Go on.", 1)
        ids = eng.tokenizer.encode(eng.tokenizer.render_chat(conv), add_special_tokens=False)
        prompt = len(ids)
        block_end = (prompt // 64 + 1) * 64  # the first block end past the prompt (checkpoints every 64)
        params = SamplingParams(temperature=0.0, max_tokens=block_end - prompt + 4, ignore_eos=True)
        tokens = [e.token_id for e in eng.submit(GenerationRequest("across", ids, params)) if e.token_id is not None]
        assert prompt + len(tokens) - 1 > block_end  # decode fed the tokens across it
        positions = eng.call(lambda: sorted(eng.memory.states.checkpoints[0])).result()
    finally:
        eng.close()
    assert block_end in positions and prompt - 1 in positions, positions


@pytest.mark.parametrize("arch", ["lfm2", "qwen3_5"])
def test_a_hybrid_conversation_resumes_on_another_engine_through_a_shared_store(folders, arch, tmp_path):
    """Engine A parks (K/V blocks, recurrent-state checkpoints) through to a real redis-server; engine B, with its
    own folder, resumes from the deepest checkpoint there, token for token as the never-parked engine."""
    from engine.config import EngineConfig
    from tests.redis_server import resume_through_store
    from tools.conversation_cache_parity import _conversation, _text

    conv_a = _conversation("You are a careful assistant. " + _text(40, 1), "Summarise this for me.", 3)
    seen = resume_through_store(EngineConfig(**_base(folders[arch], "tiered")), conv_a, tmp_path)
    assert seen.resumed == seen.reference and seen.cached >= 64  # from a checkpoint, every 64 tokens
    assert seen.stats["remote_hits"] == 1 and seen.stats["remote_refused"] == 0
