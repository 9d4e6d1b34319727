"""Hermes-style tool calls in model output, `<tool_call>{"name": ..., "arguments": ...}</tool_call>`, turned into
OpenAI `tool_calls` (the format Qwen2/2.5/3, Hermes and SmolLM3 templates teach their models)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


@dataclass(slots=True)
class ParsedOutput:
    """Model output split into what the user reads and the calls the client should run."""

    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _call_from_block(body: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):  # garbled, or nested deeper than Python's parser goes: stays text
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": obj["name"], "arguments": arguments}}


def parse_tool_calls(text: str) -> ParsedOutput:
    """Every well-formed `<tool_call>` block becomes a call; a block that is not a JSON object with a name stays in
    the content verbatim. A last block left open (generation stopped at `</tool_call>`) still counts when its JSON
    is complete. With at least one call, the remaining content is stripped and None when empty."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    pos = 0
    while True:
        start = text.find(OPEN, pos)
        if start < 0:
            kept.append(text[pos:])
            break
        end = text.find(CLOSE, start)
        stop = len(text) if end < 0 else end + len(CLOSE)
        call = _call_from_block(text[start + len(OPEN):end if end >= 0 else len(text)].strip())
        if call is None:
            kept.append(text[pos:stop])
        else:
            kept.append(text[pos:start])
            calls.append(call)
        pos = stop
        if end < 0:
            break
    content = "".join(kept)
    if not calls:
        return ParsedOutput(text)
    return ParsedOutput(content.strip() or None, calls)


def _open_prefix_len(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of OPEN (a tag that may be arriving)."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:k]):
            return k
    return 0


class ToolCallStream:
    """Streams content through until a `<tool_call>` opens; from there holds everything until `finish()`.

    Text that might be the start of the tag (`<tool`) is held back until the next delta decides it.
    """

    def __init__(self) -> None:
        self._held = ""
        self._in_call = False

    def feed(self, delta: str) -> str:
        """The part of `delta` (plus anything held back before) that is safe to send as content now."""
        if self._in_call:
            self._held += delta
            return ""
        text = self._held + delta
        start = text.find(OPEN)
        if start >= 0:
            self._in_call = True
            self._held = text[start:]
            return text[:start]
        keep = _open_prefix_len(text)
        self._held = text[len(text) - keep:]
        return text[:len(text) - keep]

    def finish(self) -> ParsedOutput:
        """What is left at the end of the stream: content to send and the parsed calls (maybe none)."""
        held, self._held = self._held, ""
        if not self._in_call:
            return ParsedOutput(held)
        parsed = parse_tool_calls(held)
        if parsed.tool_calls:
            return ParsedOutput(parsed.content or "", parsed.tool_calls)
        return ParsedOutput(held)
