"""Anthropic Messages requests (`POST /v1/messages`), as Anthropic's API reference documents them and its SDKs and
Claude Code send them: parsed strictly, then turned into the chat-template messages and OpenAI-style function tools
every API renders through (engine.server.prompts.render_prompt).

Ranges: max_tokens >= 1 (required), temperature [0, 1], top_p (0, 1], top_k >= 0, at most 16 stop_sequences.
Content blocks: text, tool_use, tool_result, thinking / redacted_thinking (kept as the assistant's reasoning);
system messages after the first turn (Claude Code's mid-conversation system beta) join the user turn beside them;
image and document blocks are refused (the models served here read text only). `cache_control` marks and fields
this server has no use for (service_tier, container, mcp_servers, ...) are accepted and ignored.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field

from engine.errors import ApiError
from engine.server.content_parts import answered, omitted
from engine.server.schemas import MAX_INT32, MAX_STOP_STRINGS, Items, StrictBody

TOOL_CHOICES = ("auto", "any", "tool", "none")


class AnthropicTool(StrictBody):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # "custom" or absent; server tools (web_search_..., bash_...) are refused


class MessagesRequest(StrictBody):
    model: str | None = None  # any name: the served model answers (Claude Code asks for a small one too)
    max_tokens: int = Field(ge=1, le=MAX_INT32)
    messages: Items[dict[str, Any]]
    system: str | Items[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP_STRINGS)
    stream: bool | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=MAX_INT32)
    metadata: dict[str, Any] | None = None
    tools: Items[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None  # a reasoning effort (engine.server.effort), where the format has one
    output_config: dict[str, Any] | None = None  # its `effort` read by engine.server.effort


class CountTokensRequest(StrictBody):
    model: str | None = None
    messages: Items[dict[str, Any]]
    system: str | Items[dict[str, Any]] | None = None
    tools: Items[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # its `effort` read by engine.server.effort


def _blocks(content: Any, param: str) -> list[dict[str, Any]]:
    """A message's content as a list of blocks: a string is one text block."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise ApiError(400, f"'{param}': expected a string or a list of content blocks, got {content!r}"[:200],
                       param=param)
    for i, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise ApiError(400, f"'{param}[{i}]': expected a content block like {{\"type\": \"text\", \"text\": "
                           "\"...\"}", param=f"{param}[{i}]")
    return content


def _text_of(block: dict[str, Any], param: str, field: str = "text") -> str:
    value = block.get(field)
    if not isinstance(value, str):
        raise ApiError(400, f"'{param}.{field}': expected a string, got {value!r}"[:200], param=f"{param}.{field}")
    return value


MEDIA_BLOCKS = ("image", "document")


def _refuse_media(kind: str, param: str) -> None:
    raise ApiError(400, f"'{param}': {kind} blocks are not supported: the model served here reads text only",
                   param=param)


def system_text(system: str | list[dict[str, Any]] | None) -> str:
    """The system prompt as one string: text blocks joined by blank lines."""
    if system is None or isinstance(system, str):
        return system or ""
    texts = []
    for i, block in enumerate(_blocks(system, "system")):
        if block["type"] != "text":
            raise ApiError(400, f"'system[{i}]': expected a text block, got type {block['type']!r}",
                           param=f"system[{i}]")
        texts.append(_text_of(block, f"system[{i}]"))
    return "\n\n".join(texts)


def _tool_result_text(block: dict[str, Any], param: str) -> str:
    content = block.get("content")
    if content is None or isinstance(content, str):
        text = content or ""
    else:
        parts = []
        for i, part in enumerate(_blocks(content, f"{param}.content")):
            if part["type"] in MEDIA_BLOCKS:  # what a tool returned (a screenshot Claude Code read): omitted
                parts.append(omitted(part["type"]))
            elif part["type"] == "text":
                parts.append(_text_of(part, f"{param}.content[{i}]"))
            else:
                raise ApiError(400, f"'{param}.content[{i}].type': {part['type']!r} is not a block a tool result "
                               "can hold; expected text, image or document", param=f"{param}.content[{i}].type")
        text = "\n".join(parts)
    return ("Error: " + text) if block.get("is_error") is True else text


def _user_turn(blocks: list[dict[str, Any]], param: str, last: bool) -> list[dict[str, Any]]:
    """A user message's blocks: tool results become tool messages (in order), text joins one user message; media
    refused in the `last` message (the one being answered), omitted before it (content_parts.py)."""
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for i, block in enumerate(blocks):
        where, kind = f"{param}[{i}]", block["type"]
        if kind == "text":
            texts.append(_text_of(block, where))
        elif kind == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str):
                raise ApiError(400, f"'{where}.tool_use_id': expected a string", param=f"{where}.tool_use_id")
            out.append({"role": "tool", "tool_call_id": call_id, "content": _tool_result_text(block, where)})
        elif kind in MEDIA_BLOCKS and not last:
            texts.append(omitted(kind))
        elif kind in MEDIA_BLOCKS:
            _refuse_media(kind, where)
        else:
            raise ApiError(400, f"'{where}.type': {kind!r} is not a block a user message can hold; expected text, "
                           "tool_result, image or document", param=f"{where}.type")
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant_turn(blocks: list[dict[str, Any]], param: str) -> dict[str, Any]:
    """An assistant message's blocks: text joined, tool_use blocks as tool calls, thinking as its reasoning."""
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    for i, block in enumerate(blocks):
        where, kind = f"{param}[{i}]", block["type"]
        if kind == "text":
            texts.append(_text_of(block, where))
        elif kind == "thinking":
            thinking.append(_text_of(block, where, "thinking"))
        elif kind == "redacted_thinking":
            continue  # opaque to any model but the one that wrote it
        elif kind == "tool_use":
            name, call_id, arguments = block.get("name"), block.get("id"), block.get("input", {})
            if not isinstance(name, str) or not name:
                raise ApiError(400, f"'{where}.name': expected the tool's name", param=f"{where}.name")
            if not isinstance(arguments, dict):
                raise ApiError(400, f"'{where}.input': expected an object, got {arguments!r}"[:200],
                               param=f"{where}.input")
            calls.append({"id": call_id if isinstance(call_id, str) else None, "type": "function",
                          "function": {"name": name, "arguments": arguments}})
        else:
            raise ApiError(400, f"'{where}.type': {kind!r} is not a block an assistant message can hold; expected "
                           "text, thinking or tool_use", param=f"{where}.type")
    out: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if thinking:
        out["reasoning_content"] = "\n".join(thinking)
    if calls:
        out["tool_calls"] = calls
    return out


def template_messages(req: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]]:
    """The request's system prompt and turns as Hugging Face chat templates expect them."""
    if not req.messages:
        raise ApiError(400, "'messages' must contain at least one message", param="messages")
    out: list[dict[str, Any]] = []
    system = system_text(req.system)
    if system:
        out.append({"role": "system", "content": system})
    # The user turn answered: the last user message that says something besides tool results (a prefill or a
    # system reminder may follow it). Its media are refused; any other message's omitted (content_parts.py).
    def kind(m: Any) -> str:  # a user message of tool results only is a tool loop's, not a question
        role = str(m.get("role")) if isinstance(m, dict) else ""
        content = m.get("content") if isinstance(m, dict) else None
        if role == "user" and isinstance(content, list) and content and all(
                isinstance(b, dict) and b.get("type") == "tool_result" for b in content):
            return "tool"
        return role

    kinds = [kind(m) for m in req.messages]
    asking = answered(kinds, max((i for i, k in enumerate(kinds) if k == "user"), default=-1))
    for i, msg in enumerate(req.messages):
        param = f"messages[{i}]"
        role = msg.get("role")
        if role not in ("user", "assistant") and not (role == "system" and i > 0):
            raise ApiError(400, f"'{param}.role': expected user or assistant (or system after the first turn), got "
                           f"{role!r}"[:200], param=f"{param}.role")
        if "content" not in msg:
            raise ApiError(400, f"'{param}.content' is required", param=f"{param}.content")
        blocks = _blocks(msg["content"], f"{param}.content")
        if role == "user":
            turns = _user_turn(blocks, f"{param}.content", i == asking)
        elif role == "system":
            turns = [{"role": "user", "content": _system_turn(blocks, f"{param}.content")}]
        else:
            turns = [_assistant_turn(blocks, f"{param}.content")]
        for turn in turns:
            if turn["role"] == "user" and out and out[-1]["role"] == "user":
                # Consecutive user turns are one turn, as Anthropic's API combines them (templates alternate).
                out[-1] = {**out[-1], "content": "\n\n".join(t for t in (out[-1]["content"], turn["content"]) if t)}
            else:
                out.append(turn)
    return out


def _system_turn(blocks: list[dict[str, Any]], param: str) -> str:
    """A system message inside `messages` (Claude Code sends them, beta mid-conversation-system-2026-04-07): its
    text, given to the model as user text where it stands, since chat templates take a system turn only first."""
    for i, block in enumerate(blocks):
        if block["type"] != "text":
            raise ApiError(400, f"'{param}[{i}]': expected a text block, got type {block['type']!r}"[:200],
                           param=f"{param}[{i}]")
    return "\n".join(_text_of(block, f"{param}[{i}]") for i, block in enumerate(blocks))


def function_tools(req: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]] | None:
    """The tools as OpenAI-style function definitions (what chat templates render); None when none are offered or
    tool_choice is none."""
    choice = req.tool_choice
    if choice is not None:
        kind = choice.get("type")
        if kind not in TOOL_CHOICES:
            raise ApiError(400, f"'tool_choice.type': expected one of {', '.join(TOOL_CHOICES)}, got {kind!r}"[:200],
                           param="tool_choice.type")
        if kind == "tool" and not isinstance(choice.get("name"), str):
            raise ApiError(400, "'tool_choice.name' is required when tool_choice.type is tool",
                           param="tool_choice.name")
        if kind == "none":
            return None
    if not req.tools:
        return None
    out = []
    for i, tool in enumerate(req.tools):
        if tool.type not in (None, "custom"):
            raise ApiError(400, f"'tools[{i}].type': server tools ({tool.type}) are not supported; define the tool "
                           "with name, description and input_schema", param=f"tools[{i}].type")
        function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema or {"type": "object"}}
        if tool.description:
            function["description"] = tool.description
        out.append({"type": "function", "function": function})
    return out


def tool_input(arguments: str) -> dict[str, Any]:
    """A parsed call's arguments (JSON text) as the object a tool_use block holds."""
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}
