"""Hermes-style <tool_call> blocks parsed into OpenAI tool_calls, whole and while streaming."""

from __future__ import annotations

import json

from engine.server.tool_calls import ToolCallStream, parse_tool_calls

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'


def test_text_without_tool_calls_is_content_unchanged():
    parsed = parse_tool_calls("  Hello <b>there</b>  ")
    assert parsed.content == "  Hello <b>there</b>  "
    assert parsed.tool_calls == []


def test_one_call_becomes_a_tool_call_with_json_arguments_and_no_content():
    parsed = parse_tool_calls(CALL)
    assert parsed.content is None
    [call] = parsed.tool_calls
    assert call["type"] == "function"
    assert call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "unit": "C"}


def test_several_calls_keep_order_and_surrounding_text_is_content():
    text = "Let me check.\n" + CALL + "\n" + CALL.replace("get_weather", "get_time") + "\n"
    parsed = parse_tool_calls(text)
    assert parsed.content == "Let me check."
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["get_weather", "get_time"]
    assert len({c["id"] for c in parsed.tool_calls}) == 2


def test_malformed_block_stays_in_content_and_valid_ones_are_parsed():
    bad = "<tool_call>{not json}</tool_call>"
    parsed = parse_tool_calls(bad + CALL)
    assert parsed.content == bad
    assert len(parsed.tool_calls) == 1
    assert parse_tool_calls(bad).content == bad
    assert parse_tool_calls('<tool_call>{"arguments": {}}</tool_call>').tool_calls == []


def test_unclosed_final_block_counts_when_its_json_is_complete():
    parsed = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"x": 1}}')
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["f"]
    truncated = '<tool_call>{"name": "f", "argum'
    assert parse_tool_calls(truncated).tool_calls == []
    assert parse_tool_calls(truncated).content == truncated


def test_string_arguments_and_parameters_spelling_are_accepted():
    parsed = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"a\\": 2}"}</tool_call>'
                              '<tool_call>{"name": "g", "parameters": {"b": 3}}</tool_call>')
    assert [json.loads(c["function"]["arguments"]) for c in parsed.tool_calls] == [{"a": 2}, {"b": 3}]
    no_args = parse_tool_calls('<tool_call>{"name": "h"}</tool_call>').tool_calls[0]
    assert no_args["function"]["arguments"] == "{}"


def _stream(deltas: list[str]) -> tuple[str, list[dict]]:
    filt = ToolCallStream()
    sent = "".join(filt.feed(d) for d in deltas)
    rest = filt.finish()
    return sent + (rest.content or ""), rest.tool_calls


def test_stream_passes_plain_text_through_token_by_token():
    filt = ToolCallStream()
    assert filt.feed("Hello") == "Hello"
    assert filt.feed(" world") == " world"
    assert filt.finish().content == ""


def test_stream_holds_a_possible_tag_start_until_decided():
    filt = ToolCallStream()
    assert filt.feed("a <to") == "a "
    assert filt.feed("day") == "<today"
    assert filt.feed("<") == ""
    assert filt.finish().content == "<"


def test_stream_buffers_from_the_tag_and_emits_calls_at_the_end():
    text = "Sure. " + CALL
    deltas = [text[i:i + 3] for i in range(0, len(text), 3)]
    filt = ToolCallStream()
    sent = "".join(filt.feed(d) for d in deltas)
    assert sent == "Sure. "
    rest = filt.finish()
    assert rest.content == ""
    assert [c["function"]["name"] for c in rest.tool_calls] == ["get_weather"]


def test_stream_releases_a_malformed_block_as_content():
    content, calls = _stream(["ok ", "<tool_call>", "{oops", "</tool_call>"])
    assert calls == []
    assert content == "ok <tool_call>{oops</tool_call>"


WEATHER_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "zip": {"type": "string"}, "options": {"type": "object"}}}}}]


def test_qwen3_coder_xml_calls_read_values_by_the_schema():
    text = ("I'll look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n<parameter=zip>\n75001\n</parameter>\n"
            "<parameter=options>\n{\"metric\": true}\n</parameter>\n</function>\n</tool_call>")
    parsed = parse_tool_calls(text, WEATHER_TOOLS)
    assert parsed.content == "I'll look."
    [call] = parsed.tool_calls
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3, "zip": "75001",
                                                          "options": {"metric": True}}


def test_mistral_calls_in_both_spellings():
    listed = parse_tool_calls('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}]', WEATHER_TOOLS)
    assert [json.loads(c["function"]["arguments"]) for c in listed.tool_calls] == [{"city": "Rome"}]
    named = parse_tool_calls('Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}', WEATHER_TOOLS)
    assert named.content == "Sure." and named.tool_calls[0]["function"]["name"] == "get_weather"
    # The marker is a control token the decoder may leave out: a whole answer that is the list still counts.
    bare = parse_tool_calls('[{"name": "get_weather", "arguments": {"city": "Lima"}}]', WEATHER_TOOLS)
    assert bare.content is None and len(bare.tool_calls) == 1


def test_llama3_json_calls_count_only_for_an_offered_tool():
    call = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Cairo"}}'
    parsed = parse_tool_calls(call, WEATHER_TOOLS)
    assert json.loads(parsed.tool_calls[0]["function"]["arguments"]) == {"city": "Cairo"}
    just_json = '{"name": "Ada", "parameters": []}'
    assert parse_tool_calls(just_json, WEATHER_TOOLS).tool_calls == [], "an answer that is JSON stays an answer"
    assert parse_tool_calls(just_json, WEATHER_TOOLS).content == just_json


def test_garbled_calls_of_every_format_stay_text():
    for text in ('<tool_call><function=get_weather><parameter=city>Paris', '[TOOL_CALLS]get_weather[ARGS]{"city"',
                 '{"name": "get_weather", "parameters": {"city": ', "[" * 5000 + "{"):
        parsed = parse_tool_calls(text, WEATHER_TOOLS)
        if parsed.tool_calls:  # an unclosed XML call is complete enough to run, as for JSON blocks
            assert text.startswith("<tool_call>")
        else:
            assert parsed.content == text


def test_stream_holds_an_answer_that_starts_as_a_json_call_and_releases_one_that_does_not():
    filt = ToolCallStream(WEATHER_TOOLS)
    assert filt.feed('{"name": "get_weather", ') == ""
    assert filt.feed('"parameters": {"city": "Bern"}}') == ""
    rest = filt.finish()
    assert rest.content == "" and rest.tool_calls[0]["function"]["name"] == "get_weather"
    filt = ToolCallStream(WEATHER_TOOLS)
    assert filt.feed("[") == ""
    assert filt.feed("See the docs]") == "[See the docs]", "a link, not a call: let through at once"
    assert filt.feed(" and [TOOL") == " and "
    assert filt.feed('_CALLS]get_weather[ARGS]{"city": "Quito"}') == ""
    assert filt.finish().tool_calls[0]["function"]["name"] == "get_weather"


def test_lfm2_python_calls_with_and_without_their_markers():
    marked = parse_tool_calls('Checking.<|tool_call_start|>[get_weather(city="Paris", days=3, metric=true), '
                              'get_weather(city=\'Oslo\', options={"units": null})]<|tool_call_end|>', WEATHER_TOOLS)
    assert marked.content == "Checking."
    assert [json.loads(c["function"]["arguments"]) for c in marked.tool_calls] == [
        {"city": "Paris", "days": 3, "metric": True}, {"city": "Oslo", "options": {"units": None}}]
    # The markers are control tokens the decoder leaves out: a whole answer of calls to offered tools counts.
    bare = parse_tool_calls('[get_weather(city="Lima")]', WEATHER_TOOLS)
    assert bare.content is None and bare.tool_calls[0]["function"]["name"] == "get_weather"
    for text in ('[print(open("x").read())]', "[get_weather(*cities)]", '[get_weather("Paris")]',
                 "[get_weather(city=__import__('os'))]", "[x for x in y]", "[get_weather(city=1+2)]"):
        parsed = parse_tool_calls(text, WEATHER_TOOLS)
        assert parsed.tool_calls == [] and parsed.content == text, text
    garbled = 'Hm.<|tool_call_start|>[get_weather(city="Pa'
    assert parse_tool_calls(garbled, WEATHER_TOOLS).content == garbled


def test_stream_holds_lfm2_calls_and_lets_a_bracketed_answer_through():
    filt = ToolCallStream(WEATHER_TOOLS)
    assert filt.feed("[get_wea") == ""
    assert filt.feed('ther(city="Bern")]') == ""
    assert filt.finish().tool_calls[0]["function"]["name"] == "get_weather"
    filt = ToolCallStream(WEATHER_TOOLS)
    assert filt.feed("[Note") == ""
    assert filt.feed(": see below]") == "[Note: see below]"
    filt = ToolCallStream(WEATHER_TOOLS)
    assert filt.feed("Sure. <|tool_call_start|>[get_weather(") == "Sure. "
    assert filt.feed('city="Rome")]<|tool_call_end|>') == ""
    assert json.loads(filt.finish().tool_calls[0]["function"]["arguments"]) == {"city": "Rome"}


def test_glm_key_value_calls_read_values_by_the_schema():
    """GLM-4.x's template writes `<tool_call>NAME` then `<arg_key>`/`<arg_value>` pairs (a value JSON unless it
    is a string); a bare name is a call only when it names an offered tool."""
    text = ("<think>The user wants weather.</think>Let me check.\n<tool_call>get_weather\n"
            "<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n"
            "<arg_key>zip</arg_key>\n<arg_value>75001</arg_value>\n<arg_key>options</arg_key>\n"
            '<arg_value>{"metric": true}</arg_value>\n</tool_call><tool_call>get_weather</tool_call>')
    parsed = parse_tool_calls(text, WEATHER_TOOLS)
    assert parsed.content == "<think>The user wants weather.</think>Let me check."
    first, second = parsed.tool_calls
    assert first["function"]["name"] == "get_weather"
    assert json.loads(first["function"]["arguments"]) == {"city": "Paris", "days": 3, "zip": "75001",
                                                           "options": {"metric": True}}
    assert json.loads(second["function"]["arguments"]) == {}
    for text in ("<tool_call>lookup</tool_call>", "<tool_call>get weather\n<arg_key>a</arg_key></tool_call>"):
        assert parse_tool_calls(text, WEATHER_TOOLS).tool_calls == [], text  # not offered / not a name
    stream = ToolCallStream(WEATHER_TOOLS)
    shown = "".join(stream.feed(piece) for piece in ("Sure.", "<tool", "_call>get_weather\n<arg_key>city",
                                                     "</arg_key>\n<arg_value>Oslo</arg_value>\n</tool_call>"))
    end = stream.finish()
    assert shown + end.content == "Sure." and json.loads(end.tool_calls[0]["function"]["arguments"]) == {"city": "Oslo"}


GEMMA4_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def test_gemma4_calls_with_strings_numbers_lists_and_objects():
    text = ('Let me check.<|tool_call>call:get_weather{city:<|"|>Paris, "FR"<|"|>,days:3,metric:true,'
            'hours:[1, 2.5],where:{lat:-1e2,note:null}}<tool_call|><|tool_call>call:get_time{}<tool_call|>')
    parsed = parse_tool_calls(text, GEMMA4_TOOLS)
    assert parsed.content == "Let me check."
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["get_weather", "get_time"]
    assert json.loads(parsed.tool_calls[0]["function"]["arguments"]) == {
        "city": 'Paris, "FR"', "days": 3, "metric": True, "hours": [1, 2.5], "where": {"lat": -100.0, "note": None}}
    assert json.loads(parsed.tool_calls[1]["function"]["arguments"]) == {}
    # Generation stopped at the end marker: the open last block still counts.
    assert parse_tool_calls('<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>}').tool_calls


def test_garbled_gemma4_calls_stay_text():
    for text in ('<|tool_call>call:get_weather{city:<|"|>Paris}<tool_call|>', "<|tool_call>get_weather{}<tool_call|>",
                 "<|tool_call>call:get_weather{city:Paris}<tool_call|>", "<|tool_call>call:f{a:1}x<tool_call|>",
                 "<|tool_call>call:f" + "{a:[" * 100 + "<tool_call|>"):
        assert parse_tool_calls(text, GEMMA4_TOOLS).tool_calls == [] and parse_tool_calls(text).content == text


def test_stream_holds_a_gemma4_call_from_its_marker():
    content, calls = _stream(["It is ", "<|tool", '_call>call:get_weather{city:<|"|>Rome<|"|>}', "<tool_call|>"])
    assert content == "It is " and len(calls) == 1
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome"}


def test_a_past_call_is_written_alike_whether_its_arguments_came_as_json_text_or_an_object():
    """Responses passes a past call's arguments as the JSON text the model wrote, Chat and Messages as an object;
    a template that cannot show tools gets the call written as the model is told to write one, either way."""
    from engine.server.tool_prompt import inline_tools

    def written(arguments: object) -> str:
        call = {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
        return inline_tools(messages, None)[1]["content"]

    expected = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert written('{"city": "Paris"}') == written({"city": "Paris"}) == expected
    assert '"arguments": "not json"' in written("not json")  # text that is no JSON stays text
