"""OpenAI Responses requests (`POST /v1/responses`), as the openai SDK's `client.responses` and Codex send them:
parsed strictly, then turned into the chat-template messages and function tools every API renders through.

Input: a string (one user message) or items: messages (`input_text` / `output_text` parts, or a string),
`function_call`, `function_call_output`, `reasoning` (its summary or content text kept as the assistant's
reasoning; `encrypted_content` alone is dropped). `input_image` / `input_file` parts and `item_reference` items are
refused; item kinds this server does not know, which carry no text for the model, are left out and logged. Tools:
`function` tools are rendered, from `tools` and from `additional_tools` input items (Codex's, in namespaces);
tools of other kinds (`web_search`, `local_shell`, `custom`, ...) are left out of the prompt, and the log says so
once per request.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import Field

from engine.errors import ApiError
from engine.server.content_parts import RESPONSES_PARTS, answered, parts_text
from engine.server.schemas import MAX_INT32, Items, Map, StrictBody

log = logging.getLogger("strata.server")
TOOL_CHOICE_MODES = ("none", "auto", "required")


class ResponsesRequest(StrictBody):
    model: str | None = None
    input: str | Items[dict[str, Any]]
    instructions: str | None = None
    tools: Items[dict[str, Any]] | None = None
    tool_choice: Any = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: Map[str] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise ApiError(400, f"'{param}': expected a string, got {value!r}"[:200], param=param)
    return value


def _last_assistant(out: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant turn that a function_call or reasoning item belongs to (a new one if the last turn isn't)."""
    if out and out[-1]["role"] == "assistant":
        return out[-1]
    turn: dict[str, Any] = {"role": "assistant", "content": ""}
    out.append(turn)
    return turn


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's input as Hugging Face chat-template messages (consecutive assistant items join one turn)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    # the user message answered (the last one): its media are refused, any other item's omitted (content_parts.py)
    kinds = [(it.get("role") if it.get("type", "message") == "message" else it.get("type")) if isinstance(it, dict)
             else "" for it in items]
    asking = answered([str(k) for k in kinds], max((i for i, k in enumerate(kinds) if k == "user"), default=-1))
    for i, item in enumerate(items):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise ApiError(400, f"'{param}': expected an input item object", param=param)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ApiError(400, f"'{param}.role': expected user, system, developer or assistant, got {role!r}"
                               [:200], param=f"{param}.role")
            text = parts_text(item.get("content"), f"{param}.content", RESPONSES_PARTS, omit_media=i != asking)
            if role == "assistant" and out and out[-1]["role"] == "assistant" and not out[-1]["content"]:
                out[-1]["content"] = text  # the answer after its own reasoning item
            else:
                out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            name = _text(item.get("name"), f"{param}.name")
            call_id = _text(item.get("call_id"), f"{param}.call_id")
            arguments = _text(item.get("arguments", ""), f"{param}.arguments")
            _last_assistant(out).setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else parts_text(output, f"{param}.output", RESPONSES_PARTS,
                                                                     omit_media=True)
            out.append({"role": "tool", "tool_call_id": _text(item.get("call_id"), f"{param}.call_id"),
                        "content": text})
        elif kind == "reasoning":
            parts = [*(item.get("content") or []), *(item.get("summary") or [])]
            text = parts_text(parts, f"{param}.summary", RESPONSES_PARTS) if parts else ""
            if text:
                _last_assistant(out)["reasoning_content"] = text
        elif kind == "additional_tools":
            continue  # tools, not a turn: function_tools reads them
        elif kind == "item_reference":
            raise ApiError(400, f"'{param}.type': item_reference items are not supported (this server keeps no "
                           "items by id); send the item itself", param=f"{param}.type")
        else:  # an item kind newer than this server, with no text for the model: leaving it out is safe
            log.info("responses: input items of type %r left out of the prompt", kind)
    return out


def function_tools(req: ResponsesRequest) -> list[dict[str, Any]] | None:
    """The function tools in chat-completions form; None when none are offered or tool_choice is none."""
    choice = req.tool_choice
    if choice is not None and not isinstance(choice, dict) and choice not in TOOL_CHOICE_MODES:
        raise ApiError(400, f"'tool_choice': expected one of {', '.join(TOOL_CHOICE_MODES)} or "
                       f"{{\"type\": \"function\", \"name\": ...}}, got {choice!r}"[:300], param="tool_choice")
    # Codex also sends tools as an `additional_tools` input item, grouped in namespaces.
    offered = [(f"tools[{i}]", tool) for i, tool in enumerate(req.tools or [])]
    if isinstance(req.input, list):
        for i, item in enumerate(req.input):
            if isinstance(item, dict) and item.get("type") == "additional_tools":
                offered += [(f"input[{i}].tools[{j}]", tool) for j, tool in enumerate(item.get("tools") or [])]
    if choice == "none" or not offered:
        return None
    out: list[dict[str, Any]] = []
    skipped: list[str] = []
    while offered:
        param, tool = offered.pop(0)
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "namespace":
            offered[:0] = [(f"{param}.tools[{j}]", t) for j, t in enumerate(tool.get("tools") or [])]
            continue
        if kind != "function":
            skipped.append(str(kind))
            continue
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise ApiError(400, f"'{param}.name': expected the function's name", param=f"{param}.name")
        function: dict[str, Any] = {"name": name, "parameters": tool.get("parameters") or {"type": "object"}}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    if skipped:
        log.info("responses: tools of type %s left out of the prompt (only function tools are offered to the "
                 "model)", ", ".join(sorted(set(skipped))))
    return out or None
