"""Two engine processes, other cache folders, one model, one redis-server: B resumes what A parked, through the
official openai SDK; the store going away leaves B serving."""

from __future__ import annotations

import openai
import pytest

from tests.engine_process import engine_process
from tests.redis_server import redis_server

SYSTEM = ("You are the archivist of a small harbour museum. You answer in one short sentence. The archive keeps "
          "tide tables, harbour master's logs, ship manifests, shipwright invoices and a keeper's letters. ") * 5


def _chat(engine, messages, max_tokens=12):
    client = openai.OpenAI(base_url=engine.base_url + "/v1", api_key="none")
    reply = client.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens, temperature=0)
    return reply.choices[0].message.content, reply.usage


def _metrics(engine) -> dict:
    status, body = engine.get_json("/metrics")
    assert status == 200 and isinstance(body, dict)
    return body["conversation_cache"]


@pytest.mark.slow  # two engine starts and three chats: ~20 s on two cores
def test_engine_b_resumes_engine_a_conversation_from_the_store_and_serves_on_when_it_stops(tmp_path):
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What do the tide tables show?"}]
    with redis_server(tmp_path) as store:
        remote = ("--conversation-cache-remote", store.url, "--conversation-cache-min-free-mib", "0")
        # A: two turns, the second from its live slot (never parked in between), then a clean stop parks it
        with engine_process("--conversation-cache-storage", "tiered", "--conversation-cache-dir",
                            str(tmp_path / "a"), *remote) as a:
            a1, _ = _chat(a, first)
            second = first + [{"role": "assistant", "content": a1}, {"role": "user", "content": "And the logs?"}]
            a2, _ = _chat(a, second)
            assert a.stop() == 0, a.logs()  # parks the live slot; the store gets it before the engine exits
        assert store.client().dbsize() > 0
        with engine_process("--conversation-cache-dir", str(tmp_path / "b"), *remote) as b:
            b2, usage = _chat(b, second)
            assert b2 == a2  # greedy: byte-identical to the engine that never parked it
            assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1  # all but the last token
            got = _metrics(b)
            assert got["remote_hits"] == 1 and got["remote_state"] == "up" and got["remote_refused"] == 0
            assert got["remote"] == store.url
            store.stop()
            other = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": SYSTEM}]
            text, usage = _chat(b, other, max_tokens=4)  # cold: the store is gone, serving is not
            got = _metrics(b)
            assert text and got["restores"] == 1 and got["remote_hits"] == 1
            assert got["remote_state"] == "down" and got["remote_error"].startswith("down: cannot reach")
            assert b.logs().count("remote store") <= 3, b.logs()
