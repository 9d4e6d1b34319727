"""A harmony model (gpt-oss's chat format, recognised from its tokenizer) through the official openai and anthropic
SDKs, streaming and not: its `analysis` comes back as reasoning (chat `reasoning_content`, Messages thinking blocks,
Responses reasoning items), its `commentary to=functions.NAME` as tool calls, the reasoning effort is read from each
API's field, and /cache/requests says what became of the reasoning the client sent back.

The model (tests/harmony_fixtures.py) answers any chat with the same reasoning and get_weather call.
"""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from tests.engine_process import engine_process
from tests.harmony_fixtures import ARGUMENTS, REASONING, TOOLS, write_harmony_model

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Current weather in a city",
                    "input_schema": TOOLS[0]["function"]["parameters"]}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = write_harmony_model(tmp_path_factory.mktemp("harmony-model"))
    with engine_process("--model", model, "--ctx-size", "1024") as engine:
        yield engine


@pytest.fixture(scope="module")
def oai(engine):
    return openai.OpenAI(base_url=engine.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(engine):
    return anthropic.Anthropic(base_url=engine.base_url, api_key="unused", max_retries=0, timeout=60)


def test_chat_returns_reasoning_and_the_call(oai):
    r = oai.chat.completions.create(model="m", messages=ASK, tools=TOOLS, temperature=0, max_tokens=16,
                                    reasoning_effort="high")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == REASONING
    [call] = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", ARGUMENTS)


def test_chat_stream_sends_reasoning_deltas_then_the_call(oai):
    chunks = list(oai.chat.completions.create(model="m", messages=ASK, tools=TOOLS, temperature=0, max_tokens=16,
                                              stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    assert reasoning == REASONING
    assert not "".join(d.content or "" for d in deltas), "no marker leaks into the content"
    [call] = [tc for d in deltas for tc in d.tool_calls or []]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_bad_reasoning_effort_is_refused(oai, claude):
    with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
        oai.chat.completions.create(model="m", messages=ASK, max_tokens=4, reasoning_effort="extreme")
    with pytest.raises(openai.BadRequestError, match="reasoning.effort"):
        oai.responses.create(model="m", input="hi", max_output_tokens=4, reasoning={"effort": "extreme"})
    with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
        claude.messages.create(model="m", max_tokens=4, messages=ASK, thinking={"type": "enabled"})
    # Harmony has no chat template to take variables: refused, not ignored.
    with pytest.raises(openai.BadRequestError, match="harmony format, which has no chat template"):
        oai.chat.completions.create(model="m", messages=ASK, max_tokens=4,
                                    extra_body={"chat_template_kwargs": {"enable_thinking": True}})


def test_messages_return_a_thinking_block_and_tool_use(claude):
    r = claude.messages.create(model="m", max_tokens=16, messages=ASK, tools=ANTHROPIC_TOOLS,
                               thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in r.content] == ["thinking", "tool_use"]
    assert r.content[0].thinking == REASONING
    assert r.content[1].name == "get_weather" and r.content[1].input == {"city": "Paris"}
    assert r.stop_reason == "tool_use"


def test_messages_stream_the_thinking_block(claude):
    with claude.messages.stream(model="m", max_tokens=16, messages=ASK, tools=ANTHROPIC_TOOLS) as stream:
        thinking = "".join(e.thinking for e in stream if e.type == "thinking")
        message = stream.get_final_message()
    assert thinking == REASONING
    assert [b.type for b in message.content] == ["thinking", "tool_use"]
    assert message.content[1].input == {"city": "Paris"}


def test_responses_return_a_reasoning_item_and_the_call(oai):
    r = oai.responses.create(model="m", input=ASK, tools=[{"type": "function", **TOOLS[0]["function"]}],
                             max_output_tokens=16, reasoning={"effort": "low"})
    assert [item.type for item in r.output] == ["reasoning", "function_call"]
    assert r.output[0].content[0].text == REASONING
    assert r.output[1].name == "get_weather" and r.output[1].arguments == ARGUMENTS
    events = list(oai.responses.create(model="m", input=ASK, tools=[{"type": "function", **TOOLS[0]["function"]}],
                                       max_output_tokens=16, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == REASONING
    done = events[-1].response
    assert [item.type for item in done.output] == ["reasoning", "function_call"]


def test_cache_requests_say_whether_past_reasoning_was_kept_or_dropped(oai, engine):
    """Within a tool loop the reasoning is kept, so the follow-up continues what the slot holds; once a final answer
    came, it is dropped and the cached prefix ends where it was."""
    def call(reasoning: str) -> dict:
        return {"role": "assistant", "content": None, "reasoning_content": reasoning, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGUMENTS}}]}

    first = oai.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=16)
    loop = [*ASK, call(REASONING), {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    oai.chat.completions.create(model="m", messages=loop, tools=TOOLS, max_tokens=2)
    after = [*loop, {"role": "assistant", "content": "Sunny.", "reasoning_content": "Say it."},
             {"role": "user", "content": "Thanks"}]
    oai.chat.completions.create(model="m", messages=after, tools=TOOLS, max_tokens=2)
    status, body = engine.get_json("/cache/requests")
    assert status == 200
    asked, kept, dropped = body["requests"][-3:]
    assert "past_reasoning" not in asked, "no reasoning was sent back"
    assert kept["past_reasoning"]["rule"] == "harmony"
    assert (kept["past_reasoning"]["kept"], kept["past_reasoning"]["dropped"]) == (1, 0)
    assert kept["past_reasoning"]["kept_tokens"] > 0
    assert kept["reason"] == "new_tokens", kept
    assert kept["reused_tokens"] >= first.usage.prompt_tokens + first.usage.completion_tokens - 1, \
        "the loop's prompt goes on from the answer as generated: reasoning and call"
    assert (dropped["past_reasoning"]["kept"], dropped["past_reasoning"]["dropped"]) == (0, 2)
    assert dropped["past_reasoning"]["dropped_tokens"] > 0
    assert dropped["reason"] == "template" and "rewritten_at" in dropped["detail"], dropped
