"""Request validation of the OpenAI routes: every bad input is a 400 that names the field, never a crash."""

from __future__ import annotations

import json

import pytest

from engine.errors import ApiError
from engine.server.prompts import active_tools, content_text, template_message
from engine.server.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    check_common,
    parse_body,
    sampling_params,
    stop_strings,
)

USER = [{"role": "user", "content": "hi"}]


def chat(**fields) -> ChatCompletionRequest:
    body = {"model": "x", "messages": USER, **fields}
    req = parse_body(ChatCompletionRequest, json.dumps(body).encode())
    check_common(req)
    return req


def refusal(**fields) -> ApiError:
    with pytest.raises(ApiError) as info:
        chat(**fields)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize("body, words", [
    (b"", "empty"),
    (b"{", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object, got an array"),
    (b'"hi"', "must be a JSON object, got a string"),
    (b'{"model": "x"}', "'messages' is required"),
    (b'{"messages": "hi"}', "'messages'"),
    (b'{"messages": [{"content": "hi"}]}', "'messages[0].role' is required"),
    (b'{"messages": [{"role": "user", "content": "\\ud83d hi"}]}', "at line 1 column 50 is half of a UTF-16 surrogate"),
    (b'{"messages": [{"role": "user", "content": "\\ude00"}]}', "half of a UTF-16 surrogate pair"),
])
def test_malformed_bodies_are_refused_with_a_reason(body, words):
    with pytest.raises(ApiError) as info:
        parse_body(ChatCompletionRequest, body)
    assert info.value.status == 400
    assert words in info.value.message


@pytest.mark.parametrize("fields, param", [
    ({"temperature": "0.5"}, "temperature"),
    ({"max_tokens": 10.5}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"stream": "yes"}, "stream"),
    ({"seed": "42"}, "seed"),
    ({"stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"messages": [{"role": "user", "content": "hi", "name": 5}]}, "messages[0].name"),
])
def test_wrong_types_name_the_field(fields, param):
    err = refusal(**fields)
    assert err.param == param
    assert param in err.message


@pytest.mark.parametrize("fields, param", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"min_p": 1.2}, "min_p"),
    ({"repeat_penalty": 0}, "repeat_penalty"),
    ({"repeat_penalty": 1000}, "repeat_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"frequency_penalty": 2.01}, "frequency_penalty"),
    ({"seed": -5}, "seed"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_tokens": 10**30}, "max_tokens"),
])
def test_out_of_range_sampling_values_are_refused(fields, param):
    err = refusal(**fields)
    assert err.param == param
    assert str(next(iter(fields.values()))) in err.message


def test_n_above_one_is_refused_as_unsupported():
    err = refusal(n=2)
    assert "n > 1 is not supported" in err.message
    assert err.param == "n"
    assert refusal(n=0).param == "n"


def test_unknown_parameters_are_ignored():
    req = chat(user="me", logit_bias={"1": 2}, parallel_tool_calls=False, some_future_option={"a": 1})
    assert req.messages[0].content == "hi"


def test_sampling_params_map_openai_and_llama_cpp_fields():
    req = chat(temperature=0, top_p=0.9, top_k=40, min_p=0.05, repeat_penalty=1.1, repeat_last_n=-1,
               presence_penalty=0.5, frequency_penalty=-0.5, seed=7, stop="END")
    params = sampling_params(req, 32, ctx_size=2048)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0, 0.9, 40, 0.05)
    assert (params.repeat_penalty, params.repeat_last_n) == (1.1, 2048)
    assert (params.presence_penalty, params.frequency_penalty, params.seed) == (0.5, -0.5, 7)
    assert (params.max_tokens, params.stop) == (32, ["END"])
    assert params.greedy


def test_defaults_follow_openai():
    params = sampling_params(chat(), None, ctx_size=2048)
    assert params.temperature == 1.0 and params.top_p == 1.0 and params.seed is None and params.max_tokens is None
    assert sampling_params(chat(seed=-1), None, 2048).seed is None  # llama.cpp: -1 = random


def test_null_means_the_default_as_in_openai():
    nulls = {name: None for name in ("temperature", "top_p", "top_k", "min_p", "repeat_penalty", "repeat_last_n",
                                     "presence_penalty", "frequency_penalty", "seed", "max_tokens", "stop", "n",
                                     "stream", "stream_options", "ignore_eos", "tools", "tool_choice")}
    req = chat(**nulls)
    assert sampling_params(req, None, 2048) == sampling_params(chat(), None, 2048)
    assert not req.stream and not req.include_usage()


def test_stop_accepts_a_string_or_a_list_of_strings():
    assert stop_strings(None) == []
    assert stop_strings("") == []
    assert stop_strings(["a", "", "b"]) == ["a", "b"]
    for bad in (5, ["a", 3], {"a": 1}, ["x"] * 17):
        with pytest.raises(ApiError) as info:
            stop_strings(bad)
        assert info.value.param == "stop"


def test_unknown_role_is_refused_with_the_known_ones():
    with pytest.raises(ApiError) as info:
        template_message(ChatMessage(role="wizard", content="hi"), 2)
    assert info.value.param == "messages[2].role"
    assert "'wizard'" in info.value.message and "assistant" in info.value.message


def test_user_message_needs_content_but_assistant_with_tool_calls_does_not():
    with pytest.raises(ApiError) as info:
        template_message(ChatMessage(role="user"), 0)
    assert info.value.param == "messages[0].content"
    msg = ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]})
    out = template_message(msg, 1)
    assert out["content"] == ""
    assert out["tool_calls"][0]["function"] == {"name": "f", "arguments": {"x": 1}}


def test_tool_and_developer_messages_map_to_template_roles():
    tool = template_message(ChatMessage(role="tool", content="22 C", tool_call_id="call_1"), 2)
    assert tool == {"role": "tool", "content": "22 C", "tool_call_id": "call_1"}
    assert template_message(ChatMessage(role="developer", content="be brief"), 0)["role"] == "system"


def test_text_content_parts_are_joined_and_other_parts_refused():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert content_text(parts, "messages[0].content") == "a\nb"
    with pytest.raises(ApiError) as info:
        content_text([{"type": "image_url", "image_url": {"url": "x"}}], "messages[0].content")
    assert "text only" in info.value.message and info.value.param == "messages[0].content[0]"
    for bad in (5, [5], [{"type": "text"}]):
        with pytest.raises(ApiError):
            content_text(bad, "messages[0].content")


def test_tools_are_offered_unless_tool_choice_is_none():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert active_tools(chat(tools=tools))[0]["function"]["name"] == "f"
    assert active_tools(chat(tools=tools, tool_choice="none")) is None
    assert active_tools(chat()) is None
    for bad in ({"tools": tools, "tool_choice": "sometimes"}, {"tool_choice": "required"}):
        with pytest.raises(ApiError) as info:
            active_tools(chat(**bad))
        assert info.value.param == "tool_choice"


@pytest.mark.parametrize("model, body", [
    ("chat", '{{"messages": {bad}}}'),
    ("chat", '{{"messages": [{{"role": "assistant", "tool_calls": {bad}}}]}}'),
    ("chat", '{{"messages": [], "tools": {bad}}}'),
    ("chat", '{{"messages": [], "metadata": {bad_map}}}'),
    ("messages", '{{"max_tokens": 1, "messages": {bad}}}'),
    ("messages", '{{"max_tokens": 1, "messages": [], "system": {bad}, "tools": {bad}}}'),
    ("responses", '{{"input": {bad}, "tools": {bad}, "metadata": {bad_map}}}'),
])
def test_a_list_or_map_of_bad_items_stops_at_the_first(model, body):
    # One error per bad item was kept before: a 2 MB body of a million of them took 1.3 GB to refuse.
    from pydantic import ValidationError

    from engine.server.anthropic_schemas import MessagesRequest
    from engine.server.responses_schemas import ResponsesRequest

    schema = {"chat": ChatCompletionRequest, "messages": MessagesRequest, "responses": ResponsesRequest}[model]
    bad = "[" + ",".join(["1"] * 1000) + "]"
    bad_map = "{" + ",".join(f'"k{i}": 1' for i in range(1000)) + "}"
    with pytest.raises(ValidationError) as refused:
        schema.model_validate_json(body.format(bad=bad, bad_map=bad_map))
    assert refused.value.error_count() <= 4  # a union's members (str | list) and each field once
