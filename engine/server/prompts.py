"""From an OpenAI request to prompt token ids: chat messages through the model's template, completion prompts
as text or token ids. Every refusal is a 400 naming the message or field at fault."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import jinja2

from engine.errors import ApiError
from engine.model.thinking import prompt_opens
from engine.server.content_parts import CHAT_PARTS, answered, parts_text
from engine.server.effort import openai_effort, openai_thinking
from engine.server.harmony_prompt import render_harmony
from engine.server.prompt_tokens import PromptIds, RenderedPrompt, encode_prompt
from engine.server.schemas import CHAT_ROLES, ChatCompletionRequest, ChatMessage
from engine.server.template_kwargs import template_kwargs
from engine.server.tool_prompt import (
    arguments_object,
    deepseek_tools,
    inline_tools,
    template_renders_tools,
    template_writes_deepseek_calls,
)

log = logging.getLogger("strata.server")
TOOL_CHOICE_MODES = ("none", "auto", "required")


def content_text(content: Any, param: str, *, omit_media: bool = False) -> str | None:
    """A chat message's content as one string: a string as is, a list of text parts joined by newlines (None: an
    assistant message with tool calls only); media refused, or omitted with `omit_media` (content_parts.py)."""
    return None if content is None else parts_text(content, param, CHAT_PARTS, omit_media=omit_media)


def template_message(msg: ChatMessage, index: int, *, last: bool = True) -> dict[str, Any]:
    """One message as Hugging Face chat templates expect it; `last`: the user message being answered, the last one
    (its media are refused; another message's, or a tool's, omitted)."""
    param = f"messages[{index}]"
    if msg.role not in CHAT_ROLES:
        raise ApiError(400, f"'{param}.role': unknown role {msg.role!r}; expected one of {', '.join(CHAT_ROLES)}",
                       param=f"{param}.role")
    text = content_text(msg.content, f"{param}.content", omit_media=not last or msg.role == "tool")
    role = "system" if msg.role == "developer" else msg.role
    out: dict[str, Any] = {"role": role}
    if role == "assistant":
        out["content"] = text or ""
        if msg.reasoning_content:
            out["reasoning_content"] = msg.reasoning_content
        if msg.tool_calls:
            out["tool_calls"] = [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name, "arguments": arguments_object(call.function.arguments)}}
                for call in msg.tool_calls
            ]
    else:
        if text is None:
            raise ApiError(400, f"'{param}.content' is required for a message with role {msg.role!r}",
                           param=f"{param}.content")
        out["content"] = text
        if role == "tool" and msg.tool_call_id is not None:
            out["tool_call_id"] = msg.tool_call_id
    if msg.name is not None:
        out["name"] = msg.name
    return out


def active_tools(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tool definitions to render and parse calls for; None when there are none or tool_choice is "none"."""
    choice = req.tool_choice
    named = isinstance(choice, dict)
    if choice is not None and not named and choice not in TOOL_CHOICE_MODES:
        raise ApiError(400, f"'tool_choice': expected one of {', '.join(TOOL_CHOICE_MODES)} or "
                       f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {choice!r}"[:300],
                       param="tool_choice")
    if not req.tools:
        if choice in ("required",) or named:
            raise ApiError(400, "'tool_choice' requires 'tools'", param="tool_choice")
        return None
    if choice == "none":
        return None
    return [tool.model_dump(exclude_none=True) for tool in req.tools]


def chat_prompt(tokenizer: Any, req: ChatCompletionRequest, ids: PromptIds | None = None
                ) -> tuple[RenderedPrompt, list[dict[str, Any]] | None]:
    """Prompt token ids for a chat request, and the tools offered (None if none)."""
    if not req.messages:
        raise ApiError(400, "'messages' must contain at least one message", param="messages")
    asking = answered([m.role for m in req.messages],
                      max((i for i, m in enumerate(req.messages) if m.role == "user"), default=-1))
    messages = [template_message(msg, i, last=i == asking) for i, msg in enumerate(req.messages)]
    tools = active_tools(req)
    effort = openai_effort(req.reasoning_effort, "reasoning_effort")
    kwargs = template_kwargs(req.chat_template_kwargs, tokenizer, ids is None or ids.contents_as_text)
    return render_prompt(tokenizer, messages, tools, ids, effort, openai_thinking(req.reasoning_effort), kwargs), tools


def render_prompt(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                  ids: PromptIds | None = None, effort: str | None = None,
                  thinking: bool | None = None, variables: dict[str, Any] | None = None,
                  continue_final: bool = False) -> RenderedPrompt:
    """Prompt token ids for messages already in Hugging Face's chat-template form, with OpenAI-style function
    tools (each API's route converts its own request to these); with `ids`, message text stays text and earlier
    answers keep the ids the engine generated for them (engine.server.prompt_tokens). `effort`: the reasoning
    effort asked for (engine.server.effort), which only the harmony format has a place for. `thinking`: whether the
    request turned the model's thinking on or off (None: it did not say), which reaches a template through the
    variable it switches thinking with (engine.model.thinking), unless the request set that variable itself. `variables`: the request's own template variables (engine.server.template_kwargs,
    checked there). `continue_final`: the last message is the start of the answer (an assistant's, Anthropic's
    prefill), which the prompt ends with instead of a new turn."""
    check_length(tokenizer, sum(len(t) for m in messages for t in _texts_of(m)), "messages")
    if continue_final:
        assert messages and messages[-1]["role"] == "assistant", "a prefill is an assistant message"
    if getattr(tokenizer, "harmony", False):
        if continue_final:
            raise ApiError(400, "this model's prompt format (harmony) cannot continue a final assistant message; "
                           "end the messages with a user turn", param="messages")
        return _encode_harmony(tokenizer, messages, tools, ids, effort)
    model = getattr(tokenizer, "thinking", None)
    extra = dict(variables or {})
    if thinking is not None and model is not None and model.switch is not None:
        extra.setdefault(model.switch, thinking)  # a variable the request named itself wins
    return _render(tokenizer, messages, tools, ids, extra, continue_final)


def _render(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
            ids: PromptIds | None, extra: dict[str, Any], continue_final: bool = False) -> RenderedPrompt:
    """The prompt through the model's own template; `extra`: variables the template reads beside the messages."""
    template = tokenizer.chat_template
    if template_renders_tools(template):
        return _encode(tokenizer, messages, tools, ids, extra, continue_final=continue_final)
    inline: Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], list[dict[str, Any]]] = inline_tools
    if template_writes_deepseek_calls(template):  # it writes past calls and results itself, never the tool list
        inline = lambda msgs, offered: deepseek_tools(msgs, offered, template)  # noqa: E731
    if continue_final:  # tools in the system turn as below, never left out: the answer is under way
        return _encode(tokenizer, inline(messages, tools), None, ids, extra, continue_final=True)
    if not tools:  # past calls and results still become text the template can show
        return _encode(tokenizer, inline(messages, None), None, ids, extra)
    # The template cannot show tools: they go into its system turn, unless that no longer fits the context; then
    # the model answers without them (as llama.cpp's server always does for such a template), and the log says so.
    prompt = _encode(tokenizer, inline(messages, tools), None, ids, extra)
    context = getattr(tokenizer, "context_tokens", None)
    if context is None or len(prompt.ids) < context:
        return prompt
    without = _encode(tokenizer, inline(messages, None), None, ids, extra)
    log.warning("the %d tools offered take the prompt to %d tokens, past the context of %d, and this model's chat "
                "template cannot show them more briefly: answering without them (%d tokens)", len(tools),
                len(prompt.ids), context, len(without.ids))
    return without


def _encode(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
            ids: PromptIds | None, extra: dict[str, Any], *, continue_final: bool = False) -> RenderedPrompt:
    try:
        text = tokenizer.render_chat(messages, tools=tools, add_generation_prompt=not continue_final, **extra)
    except (ValueError, TypeError, jinja2.TemplateError) as exc:
        # Templates refuse with raise_exception (TemplateError) or trip over a value they did not expect.
        raise ApiError(400, f"the model's chat template refused these messages: {exc}", param="messages") from None
    if continue_final:
        text = _up_to_final(tokenizer, messages, tools, extra, text)
    check_length(tokenizer, len(text), "messages")
    prompt, dropped = encode_prompt(tokenizer, text, messages, ids)
    in_thought = False if continue_final else _ends_in_thought(tokenizer, messages, tools, text, extra)
    if ids is None:  # counting tokens: nothing is served, nothing to explain
        return RenderedPrompt(prompt, in_thought=in_thought)
    rewritten = [c for c in (dropped, _history_rewritten(tokenizer, messages, tools, text, extra)) if c is not None]
    if not rewritten:
        return RenderedPrompt(prompt, in_thought=in_thought)
    # The token the rewrite falls in (the text before it tokenized alone: near enough for a report).
    return RenderedPrompt(prompt, len(tokenizer.encode(text[:min(rewritten)], add_special_tokens=False)),
                          in_thought=in_thought)


def _up_to_final(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 extra: dict[str, Any], text: str) -> str:
    """`text` (`messages` rendered without a generation prompt) cut after the final message's content, so the answer
    goes on from it (Hugging Face's continue_final_message): the content is looked for from where `text` parts
    from the earlier messages' prompt with its generation prompt (where the final turn begins; a template that
    opens a thought in its generation prompt, as DeepSeek-R1's, parts there too), and its first occurrence from
    there is taken (a later one could be inside the template's end-of-turn markup: a prefill "<" and ChatML's
    <|im_end|>). Without that prompt (a template that needs a user's turn last), the last occurrence."""
    final = messages[-1].get("content") or ""
    try:
        before = tokenizer.render_chat(messages[:-1], tools=tools, add_generation_prompt=True, **extra)
    except (ValueError, TypeError, jinja2.TemplateError):
        before = None
    start = len(os.path.commonprefix([text, before])) if before is not None else 0
    for content in (final, final.strip()):
        if not content:
            continue
        at = text.find(content, start) if before is not None else text.rfind(content)
        if at >= 0:
            return text[: at + len(content)]
    raise ApiError(400, "the model's chat template rewrites the final assistant message, so the answer cannot go "
                   "on from it; end the messages with a user turn", param="messages")


def _ends_in_thought(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, text: str,
                     extra: dict[str, Any]) -> bool:
    """Whether `text` (these messages' prompt) ends inside the thought its generation prompt opened."""
    thinking = getattr(tokenizer, "thinking", None)
    if thinking is None:
        return False
    try:
        without = tokenizer.render_chat(messages, tools=tools, add_generation_prompt=False, **extra)
    except (ValueError, TypeError, jinja2.TemplateError):  # a template that needs its generation prompt
        return False
    return prompt_opens(thinking, without, text)


def _encode_harmony(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    ids: PromptIds | None, effort: str | None) -> RenderedPrompt:
    """A harmony model's prompt (engine.server.harmony_prompt), with what became of the reasoning sent back."""
    rendered = render_harmony(messages, tools, effort)
    check_length(tokenizer, len(rendered.text), "messages")
    prompt, dropped = encode_prompt(tokenizer, rendered.text, messages, ids)
    if ids is None:  # counting tokens: nothing is served, nothing to explain
        return RenderedPrompt(prompt)
    past = None
    if rendered.dropped or rendered.kept:
        past = {"rule": "harmony", "dropped": len(rendered.dropped),
                "dropped_tokens": sum(len(tokenizer.encode(t)) for t in rendered.dropped),
                "kept": len(rendered.kept), "kept_tokens": sum(len(tokenizer.encode(t)) for t in rendered.kept)}
    at = None if dropped is None else len(tokenizer.encode(rendered.text[:dropped], add_special_tokens=False))
    return RenderedPrompt(prompt, at, past)


def _history_rewritten(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                       text: str, extra: dict[str, Any]) -> int | None:
    """Where `text` stops beginning with the prompt of the conversation's previous turn (the messages before the last
    answer) rendered now, followed by that answer as it was returned, as a character position; None when it begins
    with them (the template only appends).

    Agents send a conversation's history back unchanged, so a difference there is the template's: one that moves
    the tool list, dates its system turn, rewrites earlier turns once a later one arrives, or writes an answer
    otherwise than after its own generation prompt (trimmed, or after a line break the prompt did not end with)."""
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=0)
    if last == 0:
        return None
    try:
        earlier = tokenizer.render_chat(messages[:last], tools=tools, add_generation_prompt=True, **extra)
    except (ValueError, TypeError, jinja2.TemplateError):
        return None  # a template that refuses a history ending where this one did: nothing to compare with
    answer = messages[last]
    plain = isinstance(answer.get("content"), str) and not answer.get("tool_calls") and \
        not answer.get("reasoning_content")  # how calls and reasoning are written is each template's own
    expected = earlier + answer["content"] if plain else earlier
    if text.startswith(expected):
        return None
    return len(os.path.commonprefix([expected, text]))


def _texts_of(msg: dict[str, Any]) -> list[str]:
    return [t for t in (msg.get("content"), msg.get("reasoning_content")) if isinstance(t, str)]


def check_length(tokenizer: Any, n_chars: int, param: str) -> None:
    """A 400 for text too long to fit the context whatever its tokens, before a byte of it is tokenized."""
    limit = getattr(tokenizer, "max_prompt_chars", None)
    if limit is not None and n_chars > limit:
        raise ApiError(400, f"the prompt is {n_chars:,} characters long, more than the context can hold in any "
                       f"tokenization (at most {limit:,} characters: the context's tokens times the longest "
                       "token); shorten it", param=param)


def completion_prompt(tokenizer: Any, prompt: Any) -> list[int]:
    """Prompt token ids for /v1/completions: a string, a list of token ids, or a one-element list of either."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise ApiError(400, f"'prompt': one prompt per request is supported, got {len(prompt)}", param="prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "'prompt' is empty", param="prompt")
        check_length(tokenizer, len(prompt), "prompt")
        tokens = tokenizer.encode(prompt, add_special_tokens=True)
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not prompt:
            raise ApiError(400, "'prompt' is empty", param="prompt")
        vocab = getattr(tokenizer, "vocab_size", None)
        bad = [t for t in prompt if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            limit = f"[0, {vocab})" if vocab is not None else ">= 0"
            raise ApiError(400, f"'prompt': token ids must be in {limit}, got {bad[0]}", param="prompt")
        tokens = list(prompt)
    else:
        raise ApiError(400, f"'prompt': expected a string or a list of token ids, got {prompt!r}"[:200],
                       param="prompt")
    if not tokens:
        raise ApiError(400, "'prompt' is empty after tokenization", param="prompt")
    return tokens
