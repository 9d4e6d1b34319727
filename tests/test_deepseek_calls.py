"""DeepSeek-V3's tool calls (V3's fenced form and V3.1's bare one) parsed into OpenAI tool_calls, whole and streamed
token by token; its markers decoded as text; past calls written back through its template."""

from __future__ import annotations

import json

from engine.model.template_arguments import JsonArguments
from engine.model.tokenizer import Tokenizer
from engine.server.tool_calls import ToolCallStream, parse_tool_calls
from tests.model_fixtures import write_tokenizer_files

BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
# As DeepSeek-V3's template writes a call (llama.cpp's tests also show the closing fence right after the object).
V3 = (f'{BEGIN}{CALL}function{SEP}get_weather\n```json\n{{"city": "Paris", "days": 2}}\n```{CALL_END}'
      f'{CALL}function{SEP}get_time\n```json\n{{}}```{CALL_END}{END}')
# As V3.1's does.
V31 = f'{BEGIN}{CALL}get_weather{SEP}{{"city": "Paris", "days": 2}}{CALL_END}{CALL}get_time{SEP}{{}}{CALL_END}{END}'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def _calls(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_both_variants_become_calls_in_order_with_the_text_before_as_content():
    for text in (V3, V31):
        parsed = parse_tool_calls("Let me check." + text, TOOLS)
        assert parsed.content == "Let me check."
        assert _calls(parsed.tool_calls) == [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]
        # Generation stopped at the section's end marker (or the last call's): the open section still counts.
        assert _calls(parse_tool_calls(text.removesuffix(END)).tool_calls)[1] == ("get_time", {})
        assert _calls(parse_tool_calls(text.removesuffix(CALL_END + END)).tool_calls)[1] == ("get_time", {})


def test_garbled_deepseek_calls_stay_text():
    for text in (f"{BEGIN}{CALL}get_weather{SEP}{{city: Paris}}{CALL_END}{END}",  # not JSON
                 f"{BEGIN}{CALL}get_weather{SEP}[1, 2]{CALL_END}{END}",  # not an object
                 f"{BEGIN}{CALL}get_weather{{}}{CALL_END}{END}",  # no separator
                 f"{BEGIN}{CALL}function{SEP}get_weather\n```json\n{{\"a\": 1{CALL_END}{END}",  # fence left open
                 f"{BEGIN}{CALL}bad name{SEP}{{}}{CALL_END}{END}",
                 f"{BEGIN}{CALL}f{SEP}{{}}{CALL_END}stray{END}",
                 f"{BEGIN}{CALL}f{SEP}{{}}{CALL}g{SEP}{{}}{CALL_END}{END}",  # an earlier call left open
                 f"{BEGIN}{CALL}f{SEP}" + "[" * 100_000 + f"{CALL_END}{END}"):
        assert parse_tool_calls(text, TOOLS).tool_calls == [] and parse_tool_calls(text).content == text


def test_stream_token_by_token_sends_the_text_before_and_holds_the_calls():
    for text in (V3, V31):
        tokens = ["It ", "is ", "<", "｜", "tool", "▁calls", "▁begin", "｜>"]  # the marker arriving in pieces...
        rest = text.removeprefix(BEGIN)
        tokens += [rest[i:i + 3] for i in range(0, len(rest), 3)]  # ...then the calls a few characters a token
        stream = ToolCallStream(TOOLS)
        sent = "".join(stream.feed(t) for t in tokens)
        end = stream.finish()
        assert sent + (end.content or "") == "It is "
        assert [name for name, _ in _calls(end.tool_calls)] == ["get_weather", "get_time"]


def test_stream_releases_a_garbled_section_as_content():
    text = f"{BEGIN}{CALL}get_weather{SEP}not json{CALL_END}{END}"
    stream = ToolCallStream(TOOLS)
    sent = "".join(stream.feed(ch) for ch in text)
    end = stream.finish()
    assert sent + (end.content or "") == text and end.tool_calls == []


def test_markers_marked_special_in_tokenizer_json_decode_as_text(tmp_path):
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as FastTokenizer

    write_tokenizer_files(tmp_path)
    fast = FastTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    fast.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in (BEGIN, END, CALL, CALL_END, SEP)])
    fast.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_hf_folder(str(tmp_path))
    ids = tok.encode(V31)
    assert tok.decode(ids) == V31
    assert len(ids) < len(V31) // 2  # each marker is one token, not spelled out


def test_past_calls_join_deepseek_v3_template_strings_as_json_and_stay_objects_for_others(tmp_path):
    arguments = JsonArguments({"city": "Paris"})
    assert "```json\n" + arguments + "\n```" == '```json\n{"city": "Paris"}\n```'
    assert arguments == {"city": "Paris"} and json.dumps(arguments) == '{"city": "Paris"}'
    # The way DeepSeek-V3's template writes a past call (string concatenation), through our template renderer.
    template = ("{% for m in messages %}{% for t in m['tool_calls'] %}{{ t['type'] + '<｜tool▁sep｜>' + "
                "t['function']['name'] + '\\n```json\\n' + t['function']['arguments'] + '\\n```' }}"
                "{{ t['function']['arguments'] | tojson }}{% endfor %}{% endfor %}")
    write_tokenizer_files(tmp_path, chat_template=template)
    tok = Tokenizer.from_hf_folder(str(tmp_path))
    call = {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    out = tok.render_chat([{"role": "assistant", "content": "", "tool_calls": [call]}], add_generation_prompt=False)
    assert out == 'function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```{"city": "Paris"}'



def test_gguf_control_markers_decode_as_text_and_other_control_tokens_stay_special():
    """llama.cpp's converter makes every `<｜...｜>` token a control token, DeepSeek-V3's call markers included."""
    from tokenizers import pre_tokenizers

    eos = "<｜end▁of▁sentence｜>"
    markers = [BEGIN, END, CALL, CALL_END, SEP]
    tokens = [eos, *markers, *sorted(pre_tokenizers.ByteLevel.alphabet())]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "deepseek-v3", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3] * (1 + len(markers)) + [1] * (len(tokens) - 1 - len(markers)),
            "tokenizer.ggml.merges": [], "tokenizer.ggml.eos_token_id": 0}
    tok = Tokenizer.from_gguf_metadata(meta)
    ids = tok.encode(V31) + [0]
    assert [i for i in ids if i <= len(markers)] == [1, 3, 5, 4, 3, 5, 4, 2, 0]  # each marker one token
    assert tok.decode(ids) == V31  # the markers as text, the end of sentence left out


# DeepSeek-V3's template in brief: the system text first, then its turns, past calls as V3 writes them (string
# concatenation) and results in its own markers; it never reads `tools`.
V3_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}{% endif %}{% endfor %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' and m['tool_calls'] %}<｜Assistant｜><｜tool▁calls▁begin｜>"
    "{% for t in m['tool_calls'] %}{{ '<｜tool▁call▁begin｜>' + t['type'] + '<｜tool▁sep｜>' + t['function']['name']"
    " + '\\n```json\\n' + t['function']['arguments'] + '\\n```<｜tool▁call▁end｜>' }}{% endfor %}"
    "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
    "{% elif m['role'] == 'tool' %}<｜tool▁outputs▁begin｜>{{ m['content'] }}<｜tool▁outputs▁end｜>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>{% endif %}")


def test_a_deepseek_template_gets_the_tool_list_in_its_system_turn_and_writes_past_calls_itself(tmp_path):
    from engine.server.prompts import render_prompt

    write_tokenizer_files(tmp_path, chat_template=V3_TEMPLATE)
    tok = Tokenizer.from_hf_folder(str(tmp_path))
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                               "parameters": {"type": "object"}}}]
    for arguments in ({"city": "Paris"}, '{"city": "Paris"}'):  # as the chat and Anthropic APIs, and Responses
        call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
                    {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
        text = tok.decode(render_prompt(tok, messages, tools).ids, skip_special_tokens=False)
        system, _, turns = text.partition("<｜User｜>")
        assert system.startswith("Be brief.\n\n## Tools\n") and "### get_weather\nDescription: Current weather" in system
        assert f"{CALL}function{SEP}tool_call_name\n```json\ntool_call_arguments\n```{CALL_END}" in system
        assert turns == (f'Weather?<｜Assistant｜>{BEGIN}{CALL}function{SEP}get_weather\n```json\n{{"city": "Paris"}}\n'
                         f"```{CALL_END}{END}<｜end▁of▁sentence｜><｜tool▁outputs▁begin｜>sunny<｜tool▁outputs▁end｜>"
                         "<｜Assistant｜>")
        assert "<tool_call>" not in text
