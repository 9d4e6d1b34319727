"""The families' own tool-call formats end to end in the three APIs: a model answering in Gemma 4's
`<|tool_call>call:NAME{...}<tool_call|>`, DeepSeek-V3's fenced form or V3.1's bare one gets OpenAI `tool_calls`
(whole and streamed), an Anthropic `tool_use` block (whole and streamed) and a Responses `function_call` item, with
the arguments as JSON."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from tests.engine_process import engine_process
from tests.test_api_tools import ASK, TOOLS, write_tool_calling_model

BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FORMS = {
    "gemma4": '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:2}<tool_call|>',
    "deepseek-v3": f'{BEGIN}{CALL}function{SEP}get_weather\n```json\n{{"city": "Paris", "days": 2}}\n```{CALL_END}{END}',
    "deepseek-v3.1": f'{BEGIN}{CALL}get_weather{SEP}{{"city": "Paris", "days": 2}}{CALL_END}{END}',
}
ARGUMENTS = {"city": "Paris", "days": 2}
# An engine start of its own per form (~10 s each): the parsing itself is checked quickly in
# tests/test_server_tool_calls.py and tests/test_deepseek_calls.py.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=sorted(FORMS))
def base_url(request, tmp_path_factory):
    model = write_tool_calling_model(tmp_path_factory.mktemp(f"{request.param}-tool-model"), FORMS[request.param])
    with engine_process("--model", model, "--ctx-size", "512", "--conversation-cache-mib", "0") as engine:
        yield engine.base_url


def test_openai_chat_returns_the_call_whole_and_streamed(base_url):
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    r = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=8)
    [call] = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == ARGUMENTS
    chunks = list(client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=8, stream=True))
    calls = [tc for c in chunks if c.choices and c.choices[0].delta.tool_calls for tc in c.choices[0].delta.tool_calls]
    assert [json.loads(tc.function.arguments) for tc in calls] == [ARGUMENTS]
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_anthropic_messages_return_a_tool_use_block_whole_and_streamed(base_url):
    client = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
    tool = {"name": "get_weather", "description": "Current weather", "input_schema": TOOLS[0]["function"]["parameters"]}
    r = client.messages.create(model="m", max_tokens=8, messages=ASK, tools=[tool])
    [block] = r.content
    assert r.stop_reason == "tool_use" and block.type == "tool_use"
    assert block.name == "get_weather" and block.input == ARGUMENTS
    with client.messages.stream(model="m", max_tokens=8, messages=ASK, tools=[tool]) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.input) for b in final.content] == [("tool_use", ARGUMENTS)]


def test_responses_return_a_function_call_item(base_url):
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    function = TOOLS[0]["function"]
    r = client.responses.create(model="m", input="What is the weather in Paris?", max_output_tokens=8,
                                tools=[{"type": "function", "name": function["name"],
                                        "parameters": function["parameters"]}])
    [item] = [o for o in r.output if o.type == "function_call"]
    assert item.name == "get_weather" and json.loads(item.arguments) == ARGUMENTS
