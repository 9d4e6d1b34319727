"""Conversations survive an engine restart (tiered and disk storage), through the official openai SDK."""

from __future__ import annotations

import openai
import pytest

from tests.engine_process import engine_process

SYSTEM = ("You are a meticulous librarian. You answer in one short sentence. The catalogue lists atlases, "
          "herbariums, ship logs, railway timetables and the letters of a lighthouse keeper. ") * 6


def _chat(engine, messages):
    client = openai.OpenAI(base_url=engine.base_url + "/v1", api_key="none")
    reply = client.chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0)
    return reply.choices[0].message.content, reply.usage


def _turns():
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What do the ship logs record?"}]
    return first, lambda a1: first + [{"role": "assistant", "content": a1},
                                      {"role": "user", "content": "And the timetables?"}]


@pytest.fixture(scope="module")
def never_restarted():
    """A's two turns on one engine that never stops: the output every restarted run must reproduce."""
    first, second = _turns()
    with engine_process("--conversation-cache-mib", "0") as engine:
        a1, _ = _chat(engine, first)
        a2, _ = _chat(engine, second(a1))
    return a1, a2


@pytest.mark.parametrize("storage", ["tiered", "disk"])
def test_restart_resumes_parked_conversation_from_disk(tmp_path, storage, never_restarted):
    flags = ("--conversation-cache-storage", storage, "--conversation-cache-dir", str(tmp_path),
             "--conversation-cache-min-free-mib", "0")
    first, second = _turns()
    with engine_process(*flags) as engine:
        a1, usage1 = _chat(engine, first)
        assert a1 == never_restarted[0]
        history_tokens = usage1.prompt_tokens
        assert engine.stop() == 0, engine.logs()  # a clean shutdown parks the live slot on disk
        assert "parked" in engine.logs()

    with engine_process(*flags) as engine:
        assert "conversation cache ready: 1 conversations" in engine.logs()
        a2, usage2 = _chat(engine, second(a1))
        metrics = openai.OpenAI(base_url=engine.base_url + "/v1", api_key="none").get("/../metrics", cast_to=object)
    assert a2 == never_restarted[1]
    assert usage2.prompt_tokens_details.cached_tokens >= history_tokens - 1
    assert metrics["conversation_cache"]["restores"] == 1


def test_a_smaller_disk_budget_at_start_keeps_what_fits_and_the_pinned_and_says_so(tmp_path):
    flags = ("--conversation-cache-storage", "disk", "--conversation-cache-dir", str(tmp_path), "--parallel", "1")
    with engine_process(*flags) as engine:
        client = openai.OpenAI(base_url=engine.base_url + "/v1", api_key="none")
        for i, topic in enumerate(["atlases", "herbariums", "ship logs", "railway timetables"]):
            pin = {"strata_pin": "true"} if i == 0 else {}
            client.chat.completions.create(model="m", max_tokens=2, metadata=pin, messages=[
                {"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Tell me of the {topic}."}])
        assert engine.stop() == 0, engine.logs()
    with engine_process(*flags) as engine:
        _, listed = engine.get_json("/cache/conversations")
        rows = listed["conversations"]
        assert len(rows) == 4, rows
    # Each conversation is ~11 MiB: 1 MiB holds none of them, not even the pinned one.
    with engine_process(*flags, "--conversation-cache-disk-mib", "1") as engine:
        _, listed = engine.get_json("/cache/conversations")
        rows = listed["conversations"]
        logs = engine.logs()
    assert [r["pinned"] for r in rows] == [True], "the pinned conversation is never dropped at start"
    assert "over the disk budget of 1 MiB or 64 conversations: dropped 3 in eviction order" in logs
    assert "1 pinned conversations" in logs and "kept over the disk budget of 1 MiB" in logs
