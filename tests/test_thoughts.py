"""A thinking model's thought split from its answer: which markers a model has and whether its generation prompt
opens the thought, read from its vocabulary and template at load (Qwen3, DeepSeek-R1 and V3.1, Gemma 4 as their
templates write it); the split itself, whole and chunk by chunk; tool calls read from the answer only; the request's
thinking switch reaching the template that has one; reasoning tokens counted."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as FastTokenizer

from engine.model.thinking import Thinking
from engine.model.tokenizer import Tokenizer
from engine.server.answer_ids import AnswerIds
from engine.server.anthropic_schemas import MessagesRequest, template_messages
from engine.server.effort import messages_thinking, openai_thinking
from engine.server.model_output import output_stream, parse_output
from engine.server.prompts import render_prompt
from engine.server.responses_schemas import input_messages
from engine.server.thoughts import ThoughtStream, answer_parts, thought_tokens
from tests.model_fixtures import write_tokenizer_files

_TURNS = ("{% for m in messages %}<|im_start|>{{ m.role }}\n"
          "{% if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
          "{{ m.content }}<|im_end|>\n{% endfor %}")
# As Qwen3's template writes its generation prompt: the model opens its thought itself, unless thinking is off.
QWEN3_LIKE = _TURNS + ("{% if add_generation_prompt %}<|im_start|>assistant\n"
                       "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
                       "{% endif %}{% endif %}")
# As DeepSeek-R1's: the prompt opens the thought, always.
R1_LIKE = _TURNS + "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
# As DeepSeek-R1's writes a tool result (a template that reads `tools` gets the tool messages as they are): after
# one, its generation prompt opens no thought.
R1_TOOL_LIKE = ("{% set ns = namespace(is_tool=false) %}{% if tools %}{{ tools | length }} tools{% endif %}" + _TURNS.replace("{% for m in messages %}",
                "{% for m in messages %}{% set ns.is_tool = m.role == 'tool' %}")
                + "{% if add_generation_prompt and not ns.is_tool %}<|im_start|>assistant\n<think>\n{% endif %}"
                "{% if add_generation_prompt and ns.is_tool %}<|im_start|>assistant\n{% endif %}")
# As DeepSeek-V3.1's: thinking off unless its own variable, `thinking`, asks for it; on, the prompt opens the thought.
V31_LIKE = _TURNS + ("{% if add_generation_prompt %}<|im_start|>assistant\n"
                     "{% if thinking is defined and thinking %}<think>{% else %}<think></think>"
                     "{% endif %}{% endif %}")
# As Gemma 4's: thinking off unless asked for, an empty thought channel written for it.
GEMMA4_LIKE = ("{% for m in messages %}<|turn>{{ m.role }}\n{{ m.content }}<turn|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|turn>model\n{% if not enable_thinking | default(false) %}"
               "<|channel>thought\n<channel|>{% endif %}{% endif %}")
THINK = ("<think>", "</think>")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def tokenizer(folder: Path, template: str, tokens: tuple[str, ...] = THINK, special: bool = False) -> Tokenizer:
    folder.mkdir(parents=True, exist_ok=True)
    write_tokenizer_files(folder, template)
    fast = FastTokenizer.from_file(str(folder / "tokenizer.json"))
    fast.add_tokens([AddedToken(t, normalized=False, special=special) for t in tokens])
    fast.save(str(folder / "tokenizer.json"))
    return Tokenizer.from_hf_folder(str(folder))


def prompt_opens(tok: Tokenizer, messages: list[dict] | None = None, **variables) -> bool:
    """Whether the prompt of `messages` (one user message) ends inside an opened thought."""
    return render_prompt(tok, messages or [{"role": "user", "content": "Hi"}], None, variables=variables).in_thought


def test_markers_and_where_the_prompt_leaves_the_output_are_read_from_the_template(tmp_path):
    qwen3_tok = tokenizer(tmp_path / "qwen3", QWEN3_LIKE)
    qwen3 = qwen3_tok.thinking
    assert qwen3 is not None and (qwen3.open, qwen3.close, qwen3.switch) == ("<think>", "</think>", "enable_thinking")
    assert not prompt_opens(qwen3_tok) and not prompt_opens(qwen3_tok, enable_thinking=False)
    r1_tok = tokenizer(tmp_path / "r1", R1_LIKE)
    r1 = r1_tok.thinking
    assert r1 is not None and r1.switch is None and prompt_opens(r1_tok)
    v31_tok = tokenizer(tmp_path / "v31", V31_LIKE)
    v31 = v31_tok.thinking
    assert v31 is not None and v31.switch == "thinking"
    assert not prompt_opens(v31_tok) and prompt_opens(v31_tok, thinking=True)
    gemma4_tok = tokenizer(tmp_path / "gemma4", GEMMA4_LIKE, ("<|channel>", "<channel|>"), special=True)
    gemma4 = gemma4_tok.thinking
    assert gemma4 is not None and (gemma4.open, gemma4.close) == ("<|channel>thought", "<channel|>")
    assert gemma4.switch == "enable_thinking" and not prompt_opens(gemma4_tok)
    # Read from the request's own conversation: after a tool result R1's template opens no thought.
    r1_tools = tokenizer(tmp_path / "r1-tools", R1_TOOL_LIKE)
    assert prompt_opens(r1_tools)
    after_tool = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Looking."},
                  {"role": "tool", "content": "Sunny"}]
    assert not prompt_opens(r1_tools, after_tool)
    assert parse_output(r1_tools, "It is sunny.", None, prompt_opens(r1_tools, after_tool)).content == "It is sunny."
    # No markers in the vocabulary, or a template that never closes a thought: the output is all answer.
    assert tokenizer(tmp_path / "plain", R1_LIKE, ()).thinking is None
    assert tokenizer(tmp_path / "no-close", R1_LIKE.replace("</think>", ""), THINK).thinking is None


def test_gemma4_thought_markers_decode_as_text(tmp_path):
    tok = tokenizer(tmp_path, GEMMA4_LIKE, ("<|channel>", "<channel|>"), special=True)
    ids = tok.encode("<|channel>thought\nhmm<channel|>Hi")
    assert tok.decode(ids) == "<|channel>thought\nhmm<channel|>Hi"
    parsed = parse_output(tok, tok.decode(ids), None)
    assert (parsed.reasoning, parsed.content) == ("hmm", "Hi")


def _split(pieces: list[tuple[str, str]]) -> tuple[str, str]:
    return ("".join(t for k, t in pieces if k == "reasoning"), "".join(t for k, t in pieces if k == "content"))


def _stream(thinking, chunks: list[str], inside: bool) -> tuple[str, str]:
    stream = ThoughtStream(thinking, inside)
    pieces = [p for chunk in chunks for p in stream.feed(chunk)]
    return _split(pieces + stream.finish())


def test_the_split_is_the_same_however_the_text_is_cut(tmp_path):
    thinking = tokenizer(tmp_path, QWEN3_LIKE).thinking
    text = "<think>\nA </thing> is not the end; <think> neither.\n</think>\n\nThe answer: </think> stays."
    expected = ("A </thing> is not the end; <think> neither.", "The answer: </think> stays.")
    assert _stream(thinking, [text], False) == expected
    for cut in range(1, len(text)):
        assert _stream(thinking, [text[:cut], text[cut:]], False) == expected, cut
    assert _stream(thinking, list(text), False) == expected
    # The prompt opened the thought: only its close appears, or the model opens it again itself (the marker, not
    # thought text).
    opened = text.removeprefix("<think>\n")
    assert _stream(thinking, list(opened), True) == expected
    for cut in range(1, len(text)):
        assert _stream(thinking, [text[:cut], text[cut:]], True) == expected, cut


def test_text_that_only_starts_like_a_marker_is_answer_or_thought_as_it_stands(tmp_path):
    thinking = tokenizer(tmp_path, QWEN3_LIKE).thinking
    assert _stream(thinking, ["<thin", "king> is a tag"], False) == ("", "<thinking> is a tag")
    assert _stream(thinking, ["No thought at all."], False) == ("", "No thought at all.")
    assert _stream(thinking, ["<thi"], False) == ("", "<thi")  # ended while it could still have been one
    assert _stream(thinking, ["cut short by max_tokens </thi"], True) == ("cut short by max_tokens </thi", "")
    assert _stream(thinking, ["<think>\n\n</think>\n\nHi"], False) == ("", "Hi")  # an empty thought
    # An empty thought after the answer (Gemma 4 may end with one) is dropped, however it arrives.
    for chunks in (["Hi.<think>\n</think>"], ["Hi.<th", "ink>\n", "</thi", "nk> Bye."]):
        assert _stream(thinking, chunks, False) == ("", "".join(chunks).replace("<think>\n</think>", "")), chunks


def test_a_tool_call_is_read_after_the_thought_and_never_inside_it(tmp_path):
    tok = tokenizer(tmp_path, R1_LIKE)
    inside = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    after = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    text = f"Not {inside} yet.\n</think>\n\n{after}"
    parsed = parse_output(tok, text, TOOLS, in_thought=True)
    assert parsed.reasoning == f"Not {inside} yet." and parsed.content is None
    assert [c["function"]["arguments"] for c in parsed.tool_calls] == ['{"city": "Paris"}']
    reader = output_stream(tok, TOOLS, in_thought=True)
    pieces = [p for ch in (text[:30], text[30:70], text[70:]) for p in reader.feed(ch)]
    rest, calls = reader.finish()
    assert _split(pieces + rest) == (f"Not {inside} yet.", "")
    assert [c["function"]["arguments"] for c in calls] == ['{"city": "Paris"}']


def test_the_request_switch_reaches_only_a_template_that_reads_it(tmp_path):
    ask = [{"role": "user", "content": "Hi"}]
    qwen3 = tokenizer(tmp_path / "qwen3", QWEN3_LIKE)
    off = render_prompt(qwen3, ask, None, thinking=False)
    assert qwen3.decode(off.ids).endswith("assistant\n<think>\n\n</think>\n\n") and not off.in_thought
    assert not qwen3.decode(render_prompt(qwen3, ask, None).ids).endswith("</think>\n\n")
    v31 = tokenizer(tmp_path / "v31", V31_LIKE)  # the request's switch reaches it as its own `thinking`
    assert render_prompt(v31, ask, None, thinking=True).in_thought
    assert not render_prompt(v31, ask, None).in_thought
    # A variable the request gives itself wins, and where the prompt leaves the output is read with it.
    assert render_prompt(v31, ask, None, variables={"thinking": True}).in_thought
    assert not render_prompt(v31, ask, None, thinking=True, variables={"thinking": False}).in_thought
    r1 = tokenizer(tmp_path / "r1", R1_LIKE)  # no switch: asking thinking off changes nothing
    assert render_prompt(r1, ask, None, thinking=False) == render_prompt(r1, ask, None)
    assert render_prompt(r1, ask, None).in_thought
    # What each API's request says about thinking.
    assert (openai_thinking("none"), openai_thinking("low"), openai_thinking(None)) == (False, None, None)
    assert messages_thinking({"type": "disabled"}) is False
    assert messages_thinking({"type": "enabled", "budget_tokens": 2048}) is True
    assert messages_thinking(None) is None and messages_thinking({"type": "adaptive"}) is None


def test_past_reasoning_reaches_the_template_from_each_api(tmp_path):
    tok = tokenizer(tmp_path, QWEN3_LIKE)
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello.", "reasoning_content": "Greet."}]
    assert "<think>\nGreet.\n</think>\n\nHello." in tok.decode(render_prompt(tok, chat, None).ids)
    req = MessagesRequest.model_validate({"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Greet.", "signature": ""},
                                          {"type": "text", "text": "Hello."}]},
        {"role": "user", "content": "Again"}]})
    text = tok.decode(render_prompt(tok, template_messages(req), None).ids)
    assert "<think>\nGreet.\n</think>\n\nHello." in text
    items = [{"role": "user", "content": "Hi"},
             {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Greet."}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]}]
    text = tok.decode(render_prompt(tok, input_messages(items), None).ids)
    assert "<think>\nGreet.\n</think>\n\nHello." in text


@pytest.mark.parametrize("inside", [False, True])
def test_reasoning_tokens_are_the_thoughts(tmp_path, inside):
    tok = tokenizer(tmp_path, QWEN3_LIKE)
    thinking = tok.thinking
    thought, answer = tok.encode("I think so"), tok.encode("Yes.")
    [open_id], [close_id] = tok.encode("<think>"), tok.encode("</think>")
    ids = ([] if inside else [open_id]) + thought + [close_id] + answer
    assert thought_tokens(tok, thinking, ids, inside) == len(thought)
    assert thought_tokens(tok, thinking, answer, False) == 0
    assert thought_tokens(tok, thinking, thought, True) == len(thought)  # never closed: all of it
    assert thought_tokens(tok, thinking, [open_id, *thought, close_id], True) == len(thought)  # opened again


def test_a_close_marker_in_several_tokens_is_neither_the_thoughts_text_nor_its_count(tmp_path):
    tok = tokenizer(tmp_path, R1_LIKE, ())  # no marker tokens: the model spells '</think>' in pieces
    thinking = Thinking("<think>", "</think>", None)
    thought, answer = tok.encode("Pondering."), tok.encode("Done.")
    marker, nl = tok.encode("</think>"), tok.encode("\n")
    assert len(marker) > 1
    ids = thought + marker + nl + answer
    assert thought_tokens(tok, thinking, ids, True) == len(thought)
    parts = answer_parts(tok, thinking, ids, True)
    assert [tok.decode(part) for part in parts] == ["Pondering.", "Done."]


def test_the_thought_and_the_answer_are_remembered_apart_as_the_client_sends_them_back(tmp_path):
    tok = tokenizer(tmp_path, QWEN3_LIKE)
    thought, answer, nl = tok.encode("I think so"), tok.encode("Yes."), tok.encode("\n")
    ids = tok.encode("<think>") + nl + thought + nl + tok.encode("</think>") + nl + nl + answer + tok.encode("<|im_end|>")
    parsed = parse_output(tok, tok.decode(ids), None)
    assert answer_parts(tok, tok.thinking, ids, False) == [thought, answer]
    answers = AnswerIds()
    for part in answer_parts(tok, tok.thinking, ids, False):
        answers.remember(tok, part)
    assert (answers.get(parsed.reasoning), answers.get(parsed.content)) == (thought, answer)
    assert answer_parts(tok, tok.thinking, answer, False) == [answer]  # no thought: the output as it is
