"""Speculative verify steps through the captured CUDA decode step (engine/model/graph_verify.py).

The captured function runs eagerly on the CPU too, so a slot's several rows (its token and its drafts), the
start-up check's bookkeeping and the rows a step may feed are checked here; on a GPU (`-m gpu`) the check runs
on captured graphs, and the bundled model answers token-identically with and without prompt lookup.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.kv import KVBuffers, KVLayout
from engine.model import SeqChunk, graph_verify, load_model, plan_stages
from engine.model.graph_decode import GraphDecode
from engine.runtime.engine import Engine
from tests.model_fixtures import write_tiny_model
from tests.test_speculation import LOOPING, _accepted, _answer, _chat, _submit

CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


def _load(path: str, device: str = "cpu", dtype: torch.dtype = torch.float32):
    from engine.model.loader import read_model_config

    return load_model(path, plan_stages(read_model_config(path).n_layers, device, ""), dtype)


def _kv(lm, n_slots: int, ctx: int) -> KVBuffers:
    c = lm.config
    return KVBuffers(KVLayout(c.n_layers, c.n_kv_heads, c.head_dim, lm.dtype), n_slots, ctx, lm.model.stages)


def test_a_slots_rows_attend_to_the_rows_before_them_once_widened(llama):
    """Five rows of slot 0 (its token and four drafts) beside slot 1's row: the logits and K/V the eager pass
    computes for slot 0's five tokens as one chunk."""
    lm = _load(llama)
    kv_ref, kv_new = _kv(lm, 2, 300), _kv(lm, 2, 300)
    gen = torch.Generator().manual_seed(3)
    prompts = {0: 20, 1: 7}
    for slot, n in prompts.items():
        ids = torch.randint(0, lm.config.vocab_size, (n,), generator=gen)
        for kv in (kv_ref, kv_new):
            lm.model.forward_chunks([SeqChunk(slot, 0, ids)], kv)
    fed = torch.randint(0, lm.config.vocab_size, (5,), generator=gen)
    rows = [SeqChunk(0, 20 + j, fed[j : j + 1]) for j in range(5)] + [SeqChunk(1, 7, torch.tensor([9]))]
    runner = GraphDecode(lm.model, 2, capture=False)
    assert runner.plan(rows, kv_new) is None  # one row per slot until widened for verify steps
    runner.widen(2 * 5)
    assert runner.batches == [1, 2, 4, 8, 10] and runner.plan(rows, kv_new) == (8, 256)
    got = runner.run(rows, kv_new)
    expected = lm.model.forward_chunks([SeqChunk(0, 20, fed), SeqChunk(1, 7, torch.tensor([9]))], kv_ref,
                                       all_logits=True)
    assert got is not None
    torch.testing.assert_close(got[:5], expected[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[5:], expected[1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kv_new.read(0, 0, 25), kv_ref.read(0, 0, 25), rtol=1e-5, atol=1e-5)
    runner.widen(0)
    assert runner.batches == [1, 2] and runner.plan(rows, kv_new) is None


def test_the_check_compares_every_row_count_with_its_rows_alone(llama):
    lm = _load(llama)
    kv = _kv(lm, 2, 300)
    runner = GraphDecode(lm.model, 2, capture=False)
    runner.widen(2 * 9)
    assert graph_verify.check(runner, kv) == ""
    assert kv.read(1, 0, 9).abs().sum() > 0  # rows 1, 3, ... 17 are slot 1's positions 0..8
    assert graph_verify.check(runner, _kv(lm, 2, 8)) == "a context of 8 tokens is too short to check steps of 18 rows"


def test_a_steps_rows_stay_in_each_slots_length_bucket_and_its_copy_in_the_budget(llama):
    lm = _load(llama)
    kv = _kv(lm, 2, 1000)
    runner = GraphDecode(lm.model, 2, capture=False)
    runner.widen(2 * 9)
    assert runner.batches == [1, 2, 4, 8, 16, 18]
    verify = graph_verify.VerifyRows(runner, kv, lm.config.n_heads)
    assert verify.budget == 0  # measured in the warm-up (or at the first step that asks), once the draft and the
    # graphs hold their memory
    assert verify.rows([10], prefilling=False) == [4]  # 8 rows x 256 positions would pass the budget
    assert verify.budget == 2 * 1000  # no GPU memory to count: what a step without drafts copies at full context
    assert verify.max_length == 1000  # the attention checked row-invariant at every length bucket
    assert verify.rows([253], prefilling=False) == [3]  # 253..255: the end of its first row's bucket
    assert verify.rows([998], prefilling=False) == [1]  # the pad rows' position, ctx - 1, is next
    assert verify.rows([10, 20], prefilling=False) == [3, 1]  # 4 rows of 256 positions, the first slot first
    assert verify.rows([10, 600], prefilling=False) == [1, 1]  # a 1,000-position step: no room for drafts
    assert verify.rows([10, 20], prefilling=True) == [1, 1]  # a prefill's step runs eagerly: no drafts
    verify.max_length = 256  # as if attention over 512 positions had given a row other bits beside others
    assert verify.rows([300], prefilling=False) == [1] and verify.rows([10], prefilling=False) == [4]


def test_the_attention_check_compares_each_row_count_with_its_rows_alone():
    assert graph_verify.attention_alike([1, 2, 4, 8], 512, 4, 2, 16, torch.float32, torch.device("cpu"))


def test_a_cpu_model_verifies_without_a_check(llama):
    engine = Engine.from_config(EngineConfig(model=llama, devices="cpu", ctx_size=256, spec="prompt-lookup"))
    try:
        assert engine.scheduler.speculation.declined == "" and engine.runner.verify is None
        assert engine.runner.verify_rows([10], prefilling=False) is None  # any number of rows
    finally:
        engine.close()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_the_check_passes_on_captured_graphs(llama):
    lm = _load(llama, "cuda:0", torch.bfloat16)
    lm.model.batch_invariant = False
    kv = _kv(lm, 3, 600)
    graphs = GraphDecode(lm.model, 3)
    graphs.widen(3 * 9)
    assert graph_verify.check(graphs, kv) == ""
    assert graphs.captures == len(graphs.batches)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_a_model_on_a_gpu_answers_token_identical_with_prompt_lookup(tmp_path):
    """A random model that falls into loops (its own tokens then predict it), in bfloat16 through captured steps:
    one request at a time, then two decoding in the same steps, with and without drafts."""
    model = write_tiny_model(tmp_path, "llama", initializer_range=0.01)
    base = EngineConfig(model=model, devices="cuda:0", ctx_size=1024, parallel=2, conversation_cache_storage="ram",
                        conversation_cache_min_free_mib=0)
    answers = {}
    for key, config in (("off", base), ("on", base.replace(spec="prompt-lookup"))):
        engine = Engine.from_config(config)
        try:
            assert engine.scheduler.speculation.declined == ""
            verify = engine.runner.verify
            if key == "on":
                assert verify is not None and verify.budget > 0 and verify.max_length > 0, "measured in the warm-up"
            alone = [_answer(engine, _chat(engine, ask), 64)[0] for ask in LOOPING]
            streams = [_submit(engine, _chat(engine, ask), 48) for ask in LOOPING]
            both = [[e.token_id for e in s if e.token_id is not None] for s in streams]
            answers[key] = (alone, both, _accepted(engine))
        finally:
            engine.close()
    assert answers["on"][:2] == answers["off"][:2]
    assert answers["on"][2] > 0 and answers["off"][2] == 0
