"""gpt-oss's harmony format without a model: detection from the tokenizer, the prompt it writes (reasoning effort,
tools, past reasoning dropped or kept), and its output read back whole and token by token."""

from __future__ import annotations

import json

import pytest

from engine.errors import ApiError
from engine.model.tokenizer import Tokenizer
from engine.server.effort import messages_effort, openai_effort, responses_effort, thinking_effort
from engine.server.harmony import HarmonyStream, message_bodies, parse_harmony, reasoning_tokens
from engine.server.harmony_prompt import render_harmony
from engine.server.prompt_tokens import PromptIds
from engine.server.prompts import render_prompt
from tests.harmony_fixtures import TOOLS, harmony_tokenizer
from tests.model_fixtures import tiny_tokenizer_json

OUTPUT = ("<|channel|>analysis<|message|>Need the weather tool.<|end|>"
          "<|start|>assistant<|channel|>commentary<|message|>Checking Paris now.<|end|>"
          "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
          '{"city": "Paris"}')
ANSWER = "<|channel|>analysis<|message|>Simple.<|end|><|start|>assistant<|channel|>final<|message|>Hello there!"


def _tokenizer(backend=None) -> Tokenizer:
    from tokenizers import Tokenizer as FastTokenizer

    backend = backend or harmony_tokenizer()
    return Tokenizer(backend if isinstance(backend, FastTokenizer) else FastTokenizer.from_str(backend),
                     bos_token_id=None, eos_token_ids=[2], chat_template="{{ messages }}", fingerprint="t",
                     add_bos=False)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return _tokenizer()


def test_harmony_is_recognised_by_its_tokens_and_ends_on_return_and_call(tokenizer):
    assert tokenizer.harmony
    ids = {t: tokenizer.backend.token_to_id(t) for t in ("<|end|>", "<|return|>", "<|call|>")}
    assert ids["<|return|>"] in tokenizer.eos_token_ids and ids["<|call|>"] in tokenizer.eos_token_ids
    assert ids["<|end|>"] not in tokenizer.eos_token_ids, "the answer follows the analysis's <|end|>"
    assert not _tokenizer(tiny_tokenizer_json()).harmony


def test_decoded_output_keeps_the_markers_and_parses_token_by_token(tokenizer):
    ids = tokenizer.encode(OUTPUT)
    assert tokenizer.backend.token_to_id("<|channel|>") in ids, "the markers are single special tokens"
    decoder, stream = tokenizer.stream_decoder(), HarmonyStream()
    pieces = []
    for token in ids:
        pieces += stream.feed(decoder.push(token))
    pieces += stream.feed(decoder.flush()) + stream.finish()
    assert "".join(t for k, t in pieces if k == "reasoning") == "Need the weather tool."
    assert "".join(t for k, t in pieces if k == "content") == "Checking Paris now."
    assert all("<|" not in t for _, t in pieces), "no marker, nor a part of one, reaches the client"
    [call] = stream.tool_calls
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_message_bodies_are_found_in_the_generated_ids(tokenizer):
    """Each body's generated ids are kept for the turn that sends it back (reasoning or answer text)."""
    ids = tokenizer.encode(OUTPUT)
    bodies = [tokenizer.decode(b) for b in message_bodies(tokenizer, ids)]
    assert bodies == ["Need the weather tool.", "Checking Paris now.", '{"city": "Paris"}']
    assert reasoning_tokens(tokenizer, ids) == len(tokenizer.encode("Need the weather tool.")) > 0


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_whole_and_split_output_read_the_same(size):
    stream = HarmonyStream()
    pieces = []
    for i in range(0, len(ANSWER), size):
        pieces += stream.feed(ANSWER[i:i + size])
    pieces += stream.finish()
    kinds = [k for k, _ in pieces]
    assert kinds == sorted(kinds, reverse=True) and set(kinds) == {"reasoning", "content"}, "reasoning, then the answer"
    parsed = parse_harmony(ANSWER)
    assert (parsed.reasoning, parsed.content, parsed.tool_calls) == ("Simple.", "Hello there!", [])


def test_recipient_in_the_role_header_and_text_outside_messages():
    parsed = parse_harmony(' to=functions.lookup<|channel|>commentary json<|message|>{"q": 1}')
    assert parsed.content is None and parsed.tool_calls[0]["function"]["name"] == "lookup"
    assert parse_harmony("plain words").content == "plain words", "a model ignoring the format still answers"
    cut = parse_harmony("<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant<|channel|>fin")
    assert (cut.reasoning, cut.content) == ("Hmm.", ""), "a header cut short by max_tokens says nothing"
    assert parse_harmony("<|channel|>analy").content == ""


def test_prompt_has_effort_instructions_tools_and_the_generation_prompt():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}]
    text = render_harmony(messages, TOOLS, "high", today="2026-12-06").text
    assert text.startswith("<|start|>system<|message|>You are ChatGPT")
    assert "Current date: 2026-12-06\n\nReasoning: high\n" in text
    assert "Calls to these tools must go to the commentary channel: 'functions'." in text
    assert ("<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\n"
            "namespace functions {\n\n// Current weather in a city\ntype get_weather = (_: {\n// The city\n"
            "city: string,\n}) => any;\n\n} // namespace functions<|end|>") in text
    assert text.endswith("<|start|>user<|message|>Weather?<|end|><|start|>assistant")
    assert "Reasoning: medium" in render_harmony(messages[1:], None, None).text
    assert "<|start|>developer" not in render_harmony(messages[1:], None, None).text


def test_past_reasoning_is_dropped_after_a_final_answer_and_kept_in_a_tool_loop(tokenizer):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    loop = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "reasoning_content": "Use the tool.", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    kept = render_harmony(loop, TOOLS, None)
    assert ("<|start|>assistant<|channel|>analysis<|message|>Use the tool.<|end|><|start|>assistant<|channel|>"
            'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
            "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny<|end|>") in kept.text
    assert len(kept.kept) == 1 and not kept.dropped
    done = [*loop, {"role": "assistant", "content": "Sunny.", "reasoning_content": "Report it."},
            {"role": "user", "content": "Thanks"}]
    dropped = render_harmony(done, TOOLS, None)
    assert "Use the tool." not in dropped.text and "Report it." not in dropped.text
    assert "<|start|>assistant<|channel|>final<|message|>Sunny.<|end|>" in dropped.text
    assert len(dropped.dropped) == 2
    prompt = render_prompt(tokenizer, done, TOOLS, PromptIds())
    assert prompt.past_reasoning is not None
    assert prompt.past_reasoning["dropped"] == 2 and prompt.past_reasoning["dropped_tokens"] > 0
    assert prompt.past_reasoning["kept"] == 0
    assert prompt.rewritten_at is not None, "the cached prefix ends where the dropped reasoning was"


def test_reasoning_effort_values():
    assert [openai_effort(v, "reasoning_effort") for v in ("none", "minimal", "medium", "xhigh")] == \
        ["low", "low", "medium", "high"]
    assert responses_effort({"effort": "high", "summary": "auto"}) == "high"
    assert responses_effort(None) is None and thinking_effort(None) is None
    assert thinking_effort({"type": "disabled"}) == "low" and thinking_effort({"type": "adaptive"}) is None
    assert messages_effort({"type": "disabled"}, {"effort": "max"}) == "high"
    assert [thinking_effort({"type": "enabled", "budget_tokens": n}) for n in (1024, 4096, 32000)] == \
        ["low", "medium", "high"]
    for bad in (lambda: openai_effort("extreme", "reasoning_effort"), lambda: openai_effort(["high"], "x"),
                lambda: thinking_effort({"type": "enabled"}),
                lambda: thinking_effort({"type": "sometimes"}),
                lambda: messages_effort(None, {"effort": "huge"})):
        with pytest.raises(ApiError) as err:
            bad()
        assert err.value.status == 400


def test_tool_arguments_in_the_prompt_keep_the_clients_text():
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}
    text = render_harmony([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [call]}],
                          None, None).text
    assert 'to=functions.f <|constrain|>json<|message|>{"a":1}<|call|>' in text
    assert json.loads('{"a":1}') == {"a": 1}
