"""A thinking model's thought comes back apart from its answer in the three APIs, whole and streamed: chat's
`reasoning_content`, a Messages `thinking` block, a Responses `reasoning` item, with its tokens in the usage; a tool
call after the thought is a call, one inside it is thought.

The model's template opens the thought in its generation prompt (as DeepSeek-R1's does), so the output holds only
the close marker, which the model writes split over two tokens: the reader must join it across stream chunks."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from tests.engine_process import engine_process
from tests.test_api_tools import ASK, TOOLS, write_scripted_model
from tests.test_thoughts import R1_LIKE, THINK

INSIDE = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
PIECES = ["The user asks about the weather. ", f"Not {INSIDE} yet.\n</th", "ink>\n\n", CALL]
REASONING = f"The user asks about the weather. Not {INSIDE} yet."
PARIS = {"city": "Paris"}


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    model = write_scripted_model(tmp_path_factory.mktemp("thinking-model"), PIECES, THINK, R1_LIKE)
    with engine_process("--model", model, "--ctx-size", "512", "--conversation-cache-mib", "0") as engine:
        yield engine.base_url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_chat_returns_reasoning_content_and_only_the_call_after_the_thought(client):
    r = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=16)
    message = r.choices[0].message
    assert message.model_extra["reasoning_content"] == REASONING
    assert r.choices[0].finish_reason == "tool_calls" and message.content is None
    assert [json.loads(c.function.arguments) for c in message.tool_calls] == [PARIS]
    assert r.usage.completion_tokens_details.reasoning_tokens == 2  # the two pieces before the close marker
    plain = client.chat.completions.create(model="m", messages=ASK, max_tokens=16).choices[0].message
    assert (plain.model_extra["reasoning_content"], plain.content) == (REASONING, CALL)  # no tools: the call is text


def test_chat_streams_reasoning_deltas_then_the_call(client):
    chunks = list(client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=16, stream=True,
                                                 stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    thought = [d.model_extra.get("reasoning_content") for d in deltas if d.model_extra.get("reasoning_content")]
    assert "".join(thought) == REASONING and len(thought) == 2  # streamed as it came, the split marker held back
    assert not "".join(d.content or "" for d in deltas)
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert [json.loads(tc.function.arguments) for tc in calls] == [PARIS]
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 2


def test_messages_return_a_thinking_block_whole_and_streamed(base_url):
    client = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
    tool = {"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}
    r = client.messages.create(model="m", max_tokens=16, messages=ASK, tools=[tool])
    assert [b.type for b in r.content] == ["thinking", "tool_use"] and r.stop_reason == "tool_use"
    assert r.content[0].thinking == REASONING and r.content[1].input == PARIS
    with client.messages.stream(model="m", max_tokens=16, messages=ASK) as stream:
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == [
        ("thinking", REASONING), ("text", CALL)]


def test_responses_return_a_reasoning_item_whole_and_streamed(client):
    tools = [{"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}]
    r = client.responses.create(model="m", input="What is the weather in Paris?", max_output_tokens=16, tools=tools)
    assert [o.type for o in r.output] == ["reasoning", "function_call"]
    assert r.output[0].content[0].text == REASONING and json.loads(r.output[1].arguments) == PARIS
    assert r.usage.output_tokens_details.reasoning_tokens == 2
    events = list(client.responses.create(model="m", input="Weather?", max_output_tokens=16, stream=True))
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    done = [e.response for e in events if e.type == "response.completed"]
    assert thought == REASONING and [o.type for o in done[0].output] == ["reasoning", "message"]
    assert done[0].output_text == CALL
