"""A RAM restore into a slot on a CUDA device runs its host->device copy off the engine thread: on `--parallel 2`,
another conversation keeps decoding while the long parked one is copied back on a copy stream, the restoring
slot joins the batch once the copy landed (its record's `detail.restore_read.tokens_meanwhile` counts B's tokens
produced meanwhile), and A/B/A answers are what they are without the restore. On the CPU the same sequence
restores inline (no background read: a memcpy). Real `strata serve` processes, a tiny random-weight Llama, the
official openai SDK.

The order is the engine loop's, not a timing: the restore starts during one admission, B's slot is stepped in
that same loop iteration, and the slot joins at the earliest at the top of the next one.
"""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
import torch

from tests.engine_process import engine_process
from tests.model_fixtures import write_tiny_model
from tests.streams_beside import client_for, stream_greedy

SYSTEM = ("You are a meticulous librarian. The catalogue lists atlases, herbariums, ship logs, railway "
          "timetables and the letters of a lighthouse keeper. ") * 60  # a few thousand tokens
A_FIRST = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What do the ship logs record?"}]
B_PROMPT = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper and her cat."}]
D_PROMPT = [{"role": "user", "content": "Hi."}]
B_TOKENS = 1500  # B keeps decoding for the whole of A's return
CUDA = torch.cuda.is_available()
on_cuda = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (not run on the CPU-only machine)")]


def _ask(client: openai.OpenAI, messages: list[dict], max_tokens: int, **kw) -> str:
    done = client.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens, temperature=0, **kw)
    return done.choices[0].message.content or ""


@pytest.mark.parametrize(("device", "storage"), [
    ("cpu", "ram"),
    pytest.param("cuda:0", "ram", marks=on_cuda),
    # Read off the engine thread, then copied on the copy stream, beside captured decode steps (captures of new
    # attention lengths while the copy runs); answers then depend on what shares a step, so parity is not asked.
    pytest.param("cuda:0", "disk", marks=on_cuda),
])
def test_a_restore_joins_while_another_slot_decodes_and_answers_stay_the_same(device, storage, tmp_path):
    exact = device == "cpu" or storage == "ram"
    model = write_tiny_model(tmp_path, "llama", max_position_embeddings=8192)
    flags = ("--model", model, "--devices", device, "--parallel", "2", "--ctx-size", "8192",
             "--conversation-cache-storage", storage, "--conversation-cache-dir", str(tmp_path / "cache"),
             "--conversation-cache-min-free-mib", "0")
    flags += ("--cpu-weights", "float") if device == "cpu" else ("--deterministic",) if exact else ()
    with engine_process(*flags) as engine:
        client = client_for(engine)
        b_alone = _ask(client, B_PROMPT, B_TOKENS, extra_body={"ignore_eos": True})
        a1 = _ask(client, A_FIRST, 8)
        a_second = A_FIRST + [{"role": "assistant", "content": a1}, {"role": "user", "content": "And the maps?"}]
        a2_live = _ask(client, a_second, 8)  # A goes on in its slot: the reference for the restored turn

        chunks: list[str] = []
        started = threading.Event()
        b = threading.Thread(target=stream_greedy, args=(client, B_PROMPT, B_TOKENS, chunks, started))
        b.start()
        assert started.wait(300)
        _ask(client, D_PROMPT, 1)  # the only free slot is A's: A is parked
        a2_restored = _ask(client, a_second, 8)  # A again, restored while B decodes
        b_still_decoding = b.is_alive()
        b.join(300)
        records = httpx.get(engine.base_url + "/cache/requests", timeout=30).json()["requests"]
        logs = engine.logs()

    a_records = [r for r in records if r["name"].startswith("What do the ship logs")]
    assert len(a_records) == 3, records
    record = a_records[-1]
    assert record["source"] == storage, record
    assert record["reused_tokens"] >= a_records[1]["prompt_tokens"] - 1, record
    if exact:  # batch-invariant kernels (--deterministic on CUDA)
        assert a2_restored == a2_live  # A/B/A: the restored turn answers as the turn that kept its slot
        assert "".join(chunks) == b_alone  # B beside the restore computed exactly what it computed alone
    assert "engine step failed" not in logs, logs  # e.g. a decode capture broken by the copies beside it
    assert "restored" in logs
    if device == "cpu":  # a memcpy on the engine thread: no background read
        assert "restore_read" not in record["detail"], record
        return
    # The copy onto the GPU ran while B's slot was stepped: B produced tokens before A's slot joined.
    assert b_still_decoding, "B finished before A's return: the test saw no overlap (raise B_TOKENS)"
    read = record["detail"]["restore_read"]
    assert read["tokens_meanwhile"] >= 1, record
