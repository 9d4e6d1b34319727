"""The OpenAI-compatible API of a live `strata serve` on the bundled model, through the official openai SDK.

One engine (`--parallel 1`) serves the whole module; outputs are kept to a few tokens so the module stays fast.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.engine_process import engine_process

CTX = 1024
HELLO = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def engine():
    with engine_process("--model", "", "--parallel", "1", "--ctx-size", str(CTX),
                        "--conversation-cache-mib", "0") as proc:
        yield proc


@pytest.fixture(scope="module")
def client(engine) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(engine):
    with httpx.Client(base_url=engine.base_url, timeout=120) as c:
        yield c


def test_chat_completion_returns_text_usage_and_model(client):
    r = client.chat.completions.create(model="anything", messages=HELLO, max_tokens=4, temperature=0)
    assert r.object == "chat.completion"
    assert r.id.startswith("chatcmpl-")
    assert r.model == client.models.list().data[0].id
    [choice] = r.choices
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert 1 <= r.usage.completion_tokens <= 4
    assert r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_stream_matches_non_stream_and_reports_usage(client):
    full = client.chat.completions.create(messages=HELLO, model="m", max_tokens=5, temperature=0)
    stream = client.chat.completions.create(messages=HELLO, model="m", max_tokens=5, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_without_include_usage_has_no_usage_chunk(client):
    chunks = list(client.chat.completions.create(messages=HELLO, model="m", max_tokens=2, stream=True))
    assert all(c.choices for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_repeated_prompt_reuses_the_live_slot(client):
    messages = [{"role": "user", "content": "Name three colours of the rainbow, please."}]
    first = client.chat.completions.create(messages=messages, model="m", max_tokens=2, temperature=0)
    second = client.chat.completions.create(messages=messages, model="m", max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens
    assert cached >= second.usage.prompt_tokens - 2


def test_greedy_output_is_deterministic(client):
    outputs = {client.chat.completions.create(messages=HELLO, model="m", max_tokens=6, temperature=0,
                                              seed=None).choices[0].message.content for _ in range(2)}
    assert len(outputs) == 1


def test_seeded_sampling_repeats(client):
    runs = [client.chat.completions.create(messages=HELLO, model="m", max_tokens=6, temperature=1.0,
                                           seed=1234, extra_body={"top_k": 40, "min_p": 0.05}).choices[0].message.content
            for _ in range(2)]
    assert runs[0] == runs[1]


def test_max_completion_tokens_limits_the_output(client):
    r = client.chat.completions.create(messages=HELLO, model="m", max_completion_tokens=2, temperature=0)
    assert r.usage.completion_tokens <= 2


def test_multi_turn_with_system_developer_and_content_parts(client):
    r = client.chat.completions.create(model="m", max_tokens=2, temperature=0, messages=[
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Hi."}, {"type": "text", "text": "Who are you?"}]},
        {"role": "assistant", "content": "An assistant."},
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": "Again?"},
    ])
    assert r.choices[0].message.content is not None


def test_completion_with_text_prompt_stream_and_echo(client):
    r = client.completions.create(model="m", prompt="The capital of France is", max_tokens=4, temperature=0)
    assert r.object == "text_completion"
    text = r.choices[0].text
    assert r.usage.completion_tokens <= 4
    chunks = list(client.completions.create(model="m", prompt="The capital of France is", max_tokens=4,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens
    echoed = client.completions.create(model="m", prompt="The capital of France is", max_tokens=4, temperature=0,
                                       echo=True)
    assert echoed.choices[0].text == "The capital of France is" + text


def test_completion_accepts_token_ids(client, http):
    ids = client.completions.create(model="m", prompt=[504, 3575, 282], max_tokens=2, temperature=0)
    assert ids.usage.prompt_tokens == 3
    nested = client.completions.create(model="m", prompt=[[504, 3575, 282]], max_tokens=2, temperature=0)
    assert nested.choices[0].text == ids.choices[0].text


def test_completion_defaults_to_sixteen_tokens(client):
    r = client.completions.create(model="m", prompt="Once upon a time", temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16
    assert r.choices[0].finish_reason == "length"


def test_models_lists_and_retrieves_the_served_model(client):
    models = client.models.list().data
    assert len(models) == 1
    model = models[0]
    assert model.object == "model" and model.id
    assert client.models.retrieve(model.id).id == model.id
    # Any name is the served model (agents ask for the names they were built for; a 404 stops them).
    other = client.models.retrieve("gpt-5-codex")
    assert other.id == "gpt-5-codex" and other.owned_by == model.owned_by


def test_unknown_parameters_are_ignored(client):
    r = client.chat.completions.create(
        model="m", messages=HELLO, max_tokens=1, user="someone", logit_bias={"42": 1}, parallel_tool_calls=False,
        response_format={"type": "text"}, extra_body={"a_future_option": {"x": 1}, "cache_prompt": True},
    )
    assert r.usage.completion_tokens == 1


def test_routes_without_v1_prefix_answer_too(http):
    r = http.post("/chat/completions", json={"messages": HELLO, "max_tokens": 1})
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


def test_client_disconnect_mid_stream_frees_the_slot(engine, client, http):
    # With one slot, a stream left running would hold the next request until its last token.
    generated_before = http.get("/metrics").json()["engine"]["generated_tokens"]
    max_tokens = CTX - 64
    stream = client.chat.completions.create(messages=[{"role": "user", "content": "Tell me a long story."}],
                                            model="m", max_tokens=max_tokens, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    received = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            received += 1
            if received == 2:
                break
    stream.close()
    deadline = time.monotonic() + 15
    while http.get("/slots").json()[0]["state"] != "idle":
        assert time.monotonic() < deadline, "the slot stayed busy after the client went away"
        time.sleep(0.1)
    generated = http.get("/metrics").json()["engine"]["generated_tokens"] - generated_before
    assert generated < max_tokens // 2, f"the stream ran on after the client left ({generated} tokens)"
    started = time.monotonic()
    r = client.chat.completions.create(messages=HELLO, model="m", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens <= 2
    assert time.monotonic() - started < 15
    assert http.get("/metrics").json()["engine"]["slots_busy"] == 0


def test_client_disconnect_while_waiting_non_streaming_frees_the_slot(engine, http):
    # Long enough to outlast the client's patience at any decode speed this machine reaches (~140 tok/s).
    body = {"messages": [{"role": "user", "content": "Count to one hundred."}], "max_tokens": CTX - 64,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=engine.base_url, timeout=1.0) as impatient:
        impatient.post("/v1/chat/completions", json=body)
    deadline = time.monotonic() + 15
    while http.get("/slots").json()[0]["state"] != "idle":
        assert time.monotonic() < deadline, "the slot stayed busy after the client went away"
        time.sleep(0.1)


def test_health_slots_and_metrics_json(http, engine):
    assert http.get("/health").json()["status"] == "ok"
    [slot] = http.get("/slots").json()
    assert slot["id"] == 0 and slot["n_ctx"] == CTX and slot["state"] in ("idle", "busy")
    metrics = http.get("/metrics").json()
    stats = metrics["engine"]
    for key in ("model", "state", "slots", "slots_busy", "queued", "requests", "prompt_tokens", "cached_tokens",
                "generated_tokens", "prefill_tokens_per_s", "decode_tokens_per_s", "uptime_s", "pid"):
        assert key in stats, key
    assert stats["pid"] == engine.proc.pid
    assert stats["requests"] >= 1 and stats["generated_tokens"] >= 1
    assert metrics["conversation_cache"]["enabled"] is False


@pytest.mark.parametrize("how", [{"params": {"format": "prometheus"}}, {"headers": {"Accept": "text/plain"}}])
def test_metrics_in_prometheus_text_parse(http, how):
    r = http.get("/metrics", **how)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    samples = {s.name: s for family in text_string_to_metric_families(r.text) for s in family.samples}
    assert samples["strata_engine_requests_total"].value >= 1
    assert samples["strata_engine_slots"].value == 1
    assert samples["strata_engine_info"].labels["model"] == http.get("/v1/models").json()["data"][0]["id"]
    assert samples["strata_conversation_cache_enabled"].value == 0


# ---------------------------------------------------------------------------------------------- bad input

def assert_openai_error(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status
    return err


@pytest.mark.parametrize("body, words", [
    (b'{"messages": [{"role": "user", "content": "hi"}', "not valid JSON"),
    (b"", "empty"),
    (b"[]", "must be a JSON object"),
    (b"null", "must be a JSON object"),
    (b'{"max_tokens": 2}', "'messages' is required"),
], ids=["truncated-json", "empty-body", "array-body", "null-body", "no-messages"])
def test_malformed_bodies_get_400(http, body, words):
    err = assert_openai_error(http.post("/v1/chat/completions", content=body,
                                        headers={"Content-Type": "application/json"}))
    assert words in err["message"]
    assert err["type"] == "invalid_request_error"


CHAT_REFUSALS = [
    ({"messages": "hello"}, "messages", "valid array"),
    ({"messages": []}, "messages", "at least one message"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", "unknown role 'wizard'"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "required"),
    ({"messages": [{"role": "user", "content": 42}]}, "messages[0].content", "expected a string"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]", "text only"),
    ({"temperature": "hot"}, "temperature", "valid number"),
    ({"temperature": -1}, "temperature", "greater than or equal to 0"),
    ({"temperature": 7}, "temperature", "less than or equal to 2"),
    ({"top_p": 0}, "top_p", "greater than 0"),
    ({"top_p": 1.5}, "top_p", "less than or equal to 1"),
    ({"top_k": -3}, "top_k", "greater than or equal to 0"),
    ({"min_p": 2}, "min_p", "less than or equal to 1"),
    ({"repeat_penalty": -1}, "repeat_penalty", "greater than 0"),
    ({"presence_penalty": 9}, "presence_penalty", "less than or equal to 2"),
    ({"frequency_penalty": -9}, "frequency_penalty", "greater than or equal to -2"),
    ({"seed": "x"}, "seed", "valid integer"),
    ({"max_tokens": "10"}, "max_tokens", "valid integer"),
    ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"max_tokens": -5}, "max_tokens", "greater than or equal to 1"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", "greater than or equal to 1"),
    ({"n": 2}, "n", "n > 1 is not supported"),
    ({"stream": "yes"}, "stream", "valid boolean"),
    ({"stop": 5}, "stop", "string or a list of strings"),
    ({"tools": "all of them"}, "tools", "valid array"),
    ({"tool_choice": "sometimes"}, "tool_choice", "expected one of none, auto, required"),
    ({"messages": [{"role": "user", "content": "word " * 3000}]}, "messages", f"context holds {CTX}"),
]


def test_media_in_an_earlier_message_or_a_tool_message_is_omitted_not_refused(client):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    call = {"id": "c1", "type": "function", "function": {"name": "shot", "arguments": "{}"}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "Look at this."}, image]},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "a screenshot"}]},
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot see images."}]},
                *HELLO]
    answer = client.chat.completions.create(model="m", messages=messages, max_tokens=2)
    assert answer.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("fields, param, words", CHAT_REFUSALS, ids=[f"{p}:{w}"[:40] for _, p, w in CHAT_REFUSALS])
def test_bad_chat_requests_get_400_naming_the_field(client, fields, param, words):
    body = {"model": "m", "messages": HELLO, "max_tokens": 2, **fields}
    messages = body.pop("messages")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(messages=messages, **{"model": body.pop("model")}, extra_body=body)
    err = info.value.body
    assert err["param"] == param
    assert words in err["message"]


COMPLETION_REFUSALS = [
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": 123}, "prompt", "expected a string or a list of token ids"),
    ({"prompt": [-1, 5]}, "prompt", "token ids must be in"),
    ({"prompt": [10**9]}, "prompt", "token ids must be in"),
    ({"prompt": ["a", "b"]}, "prompt", "one prompt per request"),
    ({"prompt": "hi", "best_of": 3}, "best_of", "not supported"),
    ({"prompt": "hi", "n": 4}, "n", "n > 1 is not supported"),
]


@pytest.mark.parametrize("fields, param, words", COMPLETION_REFUSALS,
                         ids=[f"{p}:{w}"[:40] for _, p, w in COMPLETION_REFUSALS])
def test_bad_completion_requests_get_400(http, fields, param, words):
    err = assert_openai_error(http.post("/v1/completions", json={"max_tokens": 2, **fields}))
    assert err["param"] == param
    assert words in err["message"]


def test_missing_prompt_gets_400(http):
    assert "'prompt' is required" in assert_openai_error(http.post("/v1/completions", json={}))["message"]


def test_bad_control_requests_get_4xx(http):
    assert_openai_error(http.get("/metrics", params={"format": "xml"}))
    assert_openai_error(http.post("/slots/0", params={"action": "explode"}))
    assert_openai_error(http.post("/slots/abc", params={"action": "erase"}))
    assert_openai_error(http.post("/slots/99", params={"action": "erase"}), 404)
    assert_openai_error(http.post("/slots/0", params={"action": "save"}, json={"filename": "x.bin"}))
    assert_openai_error(http.get("/cache/events", params={"limit": "-3"}))
    assert_openai_error(http.post("/cache/purge", json={"tier": "attic"}))
    assert_openai_error(http.put("/cache/config", content=b"{oops", headers={"Content-Type": "application/json"}))
    assert_openai_error(http.put("/cache/config", json={"no_such_setting": 1}))
    assert_openai_error(http.put("/cache/config", json={"ctx_size": 4096}))
    assert_openai_error(http.put("/cache/config", json={"conversation_cache_mib": "lots"}))
    assert_openai_error(http.get("/no/such/route"), 404)
    assert_openai_error(http.delete("/v1/models"), 405)


def test_server_still_serves_after_bad_input(engine, client):
    r = client.chat.completions.create(messages=HELLO, model="m", max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert engine.alive()


def test_bad_input_left_no_tracebacks_in_the_log(engine):
    assert "Traceback" not in engine.logs()
