"""Anthropic's Messages API through Anthropic's own SDK against a real `strata serve`: text and system prompts,
streaming events, stop sequences, usage with the conversation cache's reuse, tool use round trips, token counting,
API keys as Anthropic's clients send them, and refusals in Anthropic's error shape."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from tests.engine_process import engine_process
from tests.test_api_tools import write_tool_calling_model

CTX = 1024
HELLO = [{"role": "user", "content": "What is the capital of France?"}]
# Anthropic's SDK no longer has sampling arguments; the API still takes temperature / top_p / top_k in the body.
GREEDY = {"temperature": 0}
WEATHER_TOOL = {"name": "get_weather", "description": "Current weather in a city",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def engine():
    with engine_process("--model", "", "--parallel", "1", "--ctx-size", str(CTX), "--api-key", "sekrit") as proc:
        yield proc


@pytest.fixture(scope="module")
def client(engine) -> anthropic.Anthropic:
    # The SDK sends the key as x-api-key, as Claude Code does.
    return anthropic.Anthropic(base_url=engine.base_url, api_key="sekrit", max_retries=0, timeout=120)


def test_a_message_answers_with_text_usage_and_end_turn(client):
    r = client.messages.create(model="claude-sonnet-4-5", max_tokens=24, messages=HELLO, extra_body=GREEDY)
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
    assert r.model == "claude-sonnet-4-5"
    [block] = r.content
    assert block.type == "text" and "Paris" in block.text
    assert r.stop_reason in ("end_turn", "max_tokens") and r.stop_sequence is None
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens > 10
    assert r.usage.cache_creation_input_tokens == 0 and 1 <= r.usage.output_tokens <= 24


def test_the_system_prompt_is_rendered_as_the_system_turn(client):
    plain = client.messages.count_tokens(model="m", messages=HELLO).input_tokens
    as_text = client.messages.count_tokens(model="m", messages=HELLO, system="Answer in French.").input_tokens
    as_blocks = client.messages.count_tokens(model="m", messages=HELLO, system=[
        {"type": "text", "text": "Answer in French.", "cache_control": {"type": "ephemeral"}}]).input_tokens
    # SmolLM2's template puts its own system turn first unless the request brings one.
    assert as_text == as_blocks and as_text != plain


def test_max_tokens_and_stop_sequences_say_why_they_stopped(client):
    r = client.messages.create(model="m", max_tokens=3, messages=HELLO, extra_body=GREEDY)
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 3
    full = client.messages.create(model="m", max_tokens=24, messages=HELLO, extra_body=GREEDY).content[0].text
    word = full.split()[2]
    cut = client.messages.create(model="m", max_tokens=24, messages=HELLO, extra_body=GREEDY, stop_sequences=[word])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert cut.content[0].text == full[:full.index(word)]


def test_a_follow_up_turn_reads_the_first_from_the_cache(client):
    first = client.messages.create(model="m", max_tokens=12, messages=HELLO, extra_body=GREEDY)
    turn = [*HELLO, {"role": "assistant", "content": first.content[0].text},
            {"role": "user", "content": "And of Italy?"}]
    second = client.messages.create(model="m", max_tokens=4, messages=turn, extra_body=GREEDY)
    total = second.usage.input_tokens + second.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens >= 0.5 * total, second.usage


def test_streaming_sends_anthropics_event_sequence(client):
    kinds = []
    with client.messages.stream(model="m", max_tokens=16, messages=HELLO, extra_body=GREEDY) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_message()
    assert kinds[0] == "message_start"
    assert kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_stop" in kinds and "message_delta" in kinds
    text = "".join(b.text for b in final.content if b.type == "text")
    plain = client.messages.create(model="m", max_tokens=16, messages=HELLO, extra_body=GREEDY)
    assert text == plain.content[0].text
    assert final.stop_reason == plain.stop_reason and final.usage.output_tokens == plain.usage.output_tokens


def test_count_tokens_counts_the_prompt(client):
    counted = client.messages.count_tokens(model="m", messages=HELLO, system="Be brief.").input_tokens
    r = client.messages.create(model="m", max_tokens=1, messages=HELLO, system="Be brief.", extra_body=GREEDY)
    assert counted == r.usage.input_tokens + r.usage.cache_read_input_tokens
    with_tool = client.messages.count_tokens(model="m", messages=HELLO, system="Be brief.", tools=[WEATHER_TOOL])
    assert with_tool.input_tokens > counted + 20


def test_any_model_name_is_the_served_model(engine, client):
    assert client.models.retrieve("claude-haiku-4-5").id == "claude-haiku-4-5"
    assert client.messages.create(model="claude-haiku-4-5", max_tokens=1, messages=HELLO).content


def test_a_wrong_or_missing_key_is_refused_in_anthropics_shape(engine):
    with pytest.raises(anthropic.AuthenticationError) as info:
        anthropic.Anthropic(base_url=engine.base_url, api_key="wrong", max_retries=0).messages.create(
            model="m", max_tokens=1, messages=HELLO)
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "authentication_error"
    bearer = httpx.post(engine.base_url + "/v1/messages", headers={"Authorization": "Bearer sekrit"},
                        json={"model": "m", "max_tokens": 1, "messages": HELLO}, timeout=60)
    assert bearer.status_code == 200


REFUSALS = [
    ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"extra_body": {"temperature": 1.5}}, "temperature", "less than or equal to 1"),
    ({"messages": []}, "messages", "at least one message"),
    ({"messages": [{"role": "system", "content": "hi"}]}, "messages[0].role", "expected user or assistant"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "x"}}]}]},
     "messages[0].content[0]", "reads text only"),
    # the user turn answered, though a prefill or a system reminder follows it
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "x"}}]},
                   {"role": "assistant", "content": "The image shows"}]}, "messages[0].content[0]", "reads text only"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "x"}}]},
                   {"role": "system", "content": "<system-reminder>be brief</system-reminder>"}]},
     "messages[0].content[0]", "reads text only"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type", "expected one of auto, any, tool, none"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type", "server tools"),
    ({"system": [{"type": "image"}]}, "system[0]", "expected a text block"),
]


@pytest.mark.parametrize("fields, param, words", REFUSALS, ids=[p for _, p, _ in REFUSALS])
def test_bad_requests_get_400_in_anthropics_shape(client, fields, param, words):
    body = {"model": "m", "max_tokens": 4, "messages": HELLO, **fields}
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(**body)
    err = info.value.body
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert param in err["error"]["message"] and words in err["error"]["message"]


def test_media_a_tool_returned_or_an_earlier_turn_held_is_omitted_not_refused(client):
    """Claude Code's Read of a PNG returns an image in a tool result, and the history keeps it every later turn:
    the conversation goes on, the model told what it cannot see (only the message being answered is refused)."""
    from engine.server.anthropic_schemas import MessagesRequest, template_messages

    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "What is in this picture?"}, image]},
        {"role": "assistant", "content": "I cannot see images."},
        {"role": "user", "content": "Then read a.png."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "read", "input": {"p": "a.png"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [image]},
                                     {"type": "tool_result", "tool_use_id": "t2", "content": None}]},
    ]
    answer = client.messages.create(model="m", max_tokens=4, messages=messages)
    assert answer.stop_reason in ("end_turn", "max_tokens")
    rendered = template_messages(MessagesRequest(model="m", max_tokens=4, messages=messages))
    omitted = "[image omitted: the model served here reads text only]"
    # a tool loop after a question with an image (a history begun with another model): answered, so omitted
    loop = [messages[0], messages[3], {"role": "user", "content": [messages[4]["content"][1]]}]
    assert template_messages(MessagesRequest(model="m", max_tokens=4, messages=loop))[0]["content"].endswith(omitted)
    assert rendered[0]["content"] == "What is in this picture?\n" + omitted
    assert [m["content"] for m in rendered[4:]] == [omitted, ""]


def test_a_final_assistant_message_is_the_start_of_the_answer(client):
    """Anthropic's prefill: the prompt ends with the assistant's text, not with that turn closed and a new one."""
    from engine.model.gguf_header import read_gguf_header
    from engine.model.loader import embedded_model_path
    from engine.model.tokenizer import Tokenizer
    from engine.server.anthropic_routes import messages_prompt
    from engine.server.anthropic_schemas import MessagesRequest

    tokenizer = Tokenizer.from_gguf_metadata(read_gguf_header(embedded_model_path()).metadata)
    for start in ("<", "im", "|", "end"):  # pieces of the template's own <|im_end|>: the cut is not there
        shown = messages_prompt(tokenizer, MessagesRequest(model="m", max_tokens=4, messages=[
            {"role": "user", "content": "Count to five."}, {"role": "assistant", "content": start}]))[0]
        assert tokenizer.decode(shown.ids).endswith("\nassistant\n" + start), start
    # a template whose generation prompt opens a thought its finished turns do not have (DeepSeek-R1's, QwQ's)
    from engine.server.prompts import render_prompt

    thinking = Tokenizer.from_gguf_metadata(read_gguf_header(embedded_model_path()).metadata)
    thinking.use_chat_template("{% for m in messages %}{% if m.role == 'user' %}[U]{{ m.content }}{% else %}[A]"
                               "{{ m.content }}[E]{% endif %}{% endfor %}{% if add_generation_prompt %}[A]<think>\n"
                               "{% endif %}")
    prefill = [{"role": "user", "content": "Give JSON."}, {"role": "assistant", "content": "{"}]
    assert thinking.decode(render_prompt(thinking, prefill, None, continue_final=True).ids).endswith("[A]{")
    messages = [{"role": "user", "content": "Count to five."}, {"role": "assistant", "content": "1, 2,"}]
    rendered, _, _ = messages_prompt(tokenizer, MessagesRequest(model="m", max_tokens=4, messages=messages))
    assert tokenizer.decode(rendered.ids).endswith("\nassistant\n1, 2,")  # no end of turn, no new turn
    closed = len(messages_prompt(tokenizer, MessagesRequest(model="m", max_tokens=4, messages=[
        *messages, {"role": "user", "content": "Go on."}]))[0].ids)
    counted = client.messages.count_tokens(model="m", messages=messages).input_tokens
    assert counted == len(rendered.ids) < closed
    answer = client.messages.create(model="m", max_tokens=4, messages=messages)
    usage = answer.usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0) == counted


def test_an_unknown_route_under_messages_speaks_anthropic(engine):
    r = httpx.get(engine.base_url + "/v1/messages/nothing", headers={"x-api-key": "sekrit"})
    assert r.status_code in (404, 405) and r.json()["type"] == "error"


# ------------------------------------------------------------------------------------------------ tool use


@pytest.fixture(scope="module")
def tool_client(tmp_path_factory):
    model = write_tool_calling_model(tmp_path_factory.mktemp("tool-model"))
    with engine_process("--model", model, "--ctx-size", "512", "--conversation-cache-mib", "0") as proc:
        yield anthropic.Anthropic(base_url=proc.base_url, api_key="unused", max_retries=0, timeout=60)


def test_a_tool_call_comes_back_as_a_tool_use_block(tool_client):
    r = tool_client.messages.create(model="m", max_tokens=8, messages=HELLO, tools=[WEATHER_TOOL])
    assert r.stop_reason == "tool_use"
    [block] = r.content
    assert block.type == "tool_use" and block.id.startswith("toolu_")
    assert block.name == "get_weather" and block.input == {"city": "Paris"}


def test_a_streamed_tool_call_arrives_as_input_json(tool_client):
    with tool_client.messages.stream(model="m", max_tokens=8, messages=HELLO, tools=[WEATHER_TOOL]) as stream:
        deltas = [e for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert [d.delta.type for d in deltas] == ["input_json_delta"]
    assert json.loads(deltas[0].delta.partial_json) == {"city": "Paris"}
    [block] = final.content
    assert block.type == "tool_use" and block.input == {"city": "Paris"} and final.stop_reason == "tool_use"


def test_the_tool_result_round_trip_is_accepted(tool_client):
    first = tool_client.messages.create(model="m", max_tokens=8, messages=HELLO, tools=[WEATHER_TOOL])
    call = first.content[0]
    turn = [*HELLO, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                          "content": [{"type": "text", "text": '{"temperature_c": 21}'}]},
                                         {"type": "text", "text": "Thanks. Anything else?"}]}]
    second = tool_client.messages.create(model="m", max_tokens=8, messages=turn, tools=[WEATHER_TOOL])
    assert second.usage.input_tokens > first.usage.input_tokens + 10
    assert second.stop_reason == "tool_use"


def test_tool_choice_none_keeps_the_call_as_text(tool_client):
    r = tool_client.messages.create(model="m", max_tokens=8, messages=HELLO, tools=[WEATHER_TOOL],
                                    tool_choice={"type": "none"})
    assert r.stop_reason == "end_turn" and r.content[0].type == "text" and "<tool_call>" in r.content[0].text


def test_a_parked_conversation_says_it_came_through_the_messages_api(engine, client):
    client.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "Name a river in Spain."}])
    client.messages.create(model="m", max_tokens=2, messages=HELLO)  # takes the slot: the river is parked
    rows = httpx.get(engine.base_url + "/cache/conversations", headers={"x-api-key": "sekrit"}).json()["conversations"]
    [river] = [r for r in rows if r["name"] == "Name a river in Spain."]
    assert river["client"].startswith("Anthropic/Python") and river["client"].endswith(" · Messages"), river
