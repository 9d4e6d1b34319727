"""OpenAI's Responses API through the official openai SDK (`client.responses`) against a real `strata serve`: text,
instructions, streaming events, usage with the conversation cache's reuse, stored responses continued with
previous_response_id, function calls and their outputs, and refusals in OpenAI's error shape."""

from __future__ import annotations

import json

import openai
import pytest

from tests.engine_process import engine_process
from tests.test_api_tools import write_tool_calling_model

CTX = 1024
QUESTION = "What is the capital of France?"
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def client():
    with engine_process("--model", "", "--parallel", "1", "--ctx-size", str(CTX)) as proc:
        yield openai.OpenAI(base_url=proc.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_string_input_answers_with_an_output_message(client):
    r = client.responses.create(model="gpt-5-codex", input=QUESTION, max_output_tokens=24, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "gpt-5-codex"
    assert r.status in ("completed", "incomplete")
    [item] = r.output
    assert item.type == "message" and item.role == "assistant"
    assert "Paris" in r.output_text
    assert r.usage.input_tokens > 10 and 1 <= r.usage.output_tokens <= 24
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_max_output_tokens_makes_it_incomplete(client):
    r = client.responses.create(model="m", input=QUESTION, max_output_tokens=2, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 2
    assert [item.status for item in r.output] == ["incomplete"] and r.output_text  # cut, as OpenAI marks it, kept
    events = list(client.responses.create(model="m", input=QUESTION, max_output_tokens=2, temperature=0, stream=True))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [item.status for item in done] == ["incomplete"] and events[-1].type == "response.incomplete"
    assert done[0].content[0].text == events[-1].response.output_text == r.output_text


def test_instructions_and_message_items_render_like_chat(client):
    items = [{"role": "developer", "content": "Answer briefly."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
    as_items = client.responses.create(model="m", input=items, max_output_tokens=1, temperature=0)
    as_instructions = client.responses.create(model="m", instructions="Answer briefly.", input=QUESTION,
                                              max_output_tokens=1, temperature=0)
    assert as_items.usage.input_tokens == as_instructions.usage.input_tokens


def test_previous_response_id_continues_from_the_cache(client):
    first = client.responses.create(model="m", input=QUESTION, max_output_tokens=12, temperature=0)
    second = client.responses.create(model="m", previous_response_id=first.id, input="And of Italy?",
                                     max_output_tokens=4, temperature=0)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 0.5 * second.usage.input_tokens
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="m", previous_response_id=first.id, input="Again?", max_output_tokens=1)
    assert info.value.body["param"] == "previous_response_id" and "not found" in info.value.body["message"]


def test_store_false_keeps_nothing(client):
    r = client.responses.create(model="m", input=QUESTION, max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_streaming_sends_the_responses_events(client):
    events = list(client.responses.create(model="m", input=QUESTION, max_output_tokens=16, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert "response.output_item.added" in kinds and "response.output_text.done" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    plain = client.responses.create(model="m", input=QUESTION, max_output_tokens=16, temperature=0)
    assert text == plain.output_text == events[-1].response.output_text


REFUSALS = [
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role", "expected user, system"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]",
     "reads text only"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type", "not supported"),
    ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
    ({"temperature": 3}, "temperature", "less than or equal to 2"),
    ({"tool_choice": "sometimes"}, "tool_choice", "expected one of none, auto, required"),
    ({"input": []}, "input", "at least one item"),
]


@pytest.mark.parametrize("fields, param, words", REFUSALS, ids=[p for _, p, _ in REFUSALS])
def test_bad_requests_get_400_naming_the_field(client, fields, param, words):
    body = {"model": "m", "input": QUESTION, **fields}
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**body)
    assert info.value.body["param"] == param and words in info.value.body["message"]


def test_media_in_earlier_input_or_a_function_output_is_omitted_not_refused(client):
    image = {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}
    turn = [{"role": "user", "content": [{"type": "input_text", "text": "Look at this."}, image]},
            {"type": "function_call", "call_id": "c1", "name": "shot", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": [image]},
            {"role": "user", "content": QUESTION}]
    assert client.responses.create(model="m", input=turn, max_output_tokens=4, store=False).status in (
        "completed", "incomplete")


# ------------------------------------------------------------------------------------------------ function calls


@pytest.fixture(scope="module")
def tool_client(tmp_path_factory):
    model = write_tool_calling_model(tmp_path_factory.mktemp("tool-model"))
    with engine_process("--model", model, "--ctx-size", "512", "--conversation-cache-mib", "0") as proc:
        yield openai.OpenAI(base_url=proc.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_a_tool_call_comes_back_as_a_function_call_item(tool_client):
    r = tool_client.responses.create(model="m", input=QUESTION, tools=[WEATHER, {"type": "web_search"}],
                                     max_output_tokens=8)
    [item] = r.output
    assert item.type == "function_call" and item.name == "get_weather" and item.call_id.startswith("call_")
    assert json.loads(item.arguments) == {"city": "Paris"} and r.status == "completed"


def test_a_streamed_tool_call_sends_its_arguments(tool_client):
    events = list(tool_client.responses.create(model="m", input=QUESTION, tools=[WEATHER], max_output_tokens=8,
                                               stream=True))
    [delta] = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert json.loads(delta.delta) == {"city": "Paris"}
    [item] = events[-1].response.output
    assert item.type == "function_call" and item.name == "get_weather"


def test_the_function_call_output_round_trip_is_accepted(tool_client):
    first = tool_client.responses.create(model="m", input=QUESTION, tools=[WEATHER], max_output_tokens=8,
                                         store=False)
    call = first.output[0]
    turn = [{"role": "user", "content": QUESTION},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature_c": 21}'}]
    second = tool_client.responses.create(model="m", input=turn, tools=[WEATHER], max_output_tokens=8, store=False)
    assert second.usage.input_tokens > first.usage.input_tokens + 10
    assert second.output[0].type == "function_call"


def test_tools_in_an_additional_tools_item_are_offered_as_codex_sends_them(tool_client):
    # Codex's default request: its tools in an input item, grouped in a namespace, beside kinds no model here runs.
    item = {"type": "additional_tools", "role": "developer", "tools": [
        {"type": "namespace", "name": "functions", "tools": [WEATHER, {"type": "custom", "name": "exec"}]}]}
    r = tool_client.responses.create(model="m", input=[item, {"role": "user", "content": QUESTION}],
                                     max_output_tokens=8, store=False)
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather"


def test_an_input_item_kind_this_server_does_not_know_is_left_out(client):
    known = client.responses.create(model="m", input=QUESTION, max_output_tokens=1, store=False)
    unknown = client.responses.create(model="m", max_output_tokens=1, store=False, input=[
        {"type": "future_item_kind", "id": "x1"}, {"role": "user", "content": QUESTION}])
    assert unknown.usage.input_tokens == known.usage.input_tokens
