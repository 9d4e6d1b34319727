"""A model's output as every API route reads it: reasoning, answer text and tool calls, whole or as it streams.

A harmony model (engine.server.harmony) marks all three; any other model's output is answer text with tool calls in
its family's form (engine.server.tool_calls), read only when tools were offered.
"""

from __future__ import annotations

from typing import Any, Protocol

from engine.server.harmony import HarmonyStream, Piece, parse_harmony
from engine.server.tool_calls import ParsedOutput, ToolCallStream, parse_tool_calls


class OutputStream(Protocol):
    def feed(self, text: str) -> list[Piece]:
        """The reasoning and answer text certain so far, in order."""
        ...

    def finish(self) -> tuple[list[Piece], list[dict[str, Any]]]:
        """The rest once generation ended, and the tool calls found (OpenAI's form)."""
        ...


class _Harmony:
    def __init__(self) -> None:
        self._stream = HarmonyStream()

    def feed(self, text: str) -> list[Piece]:
        return self._stream.feed(text)

    def finish(self) -> tuple[list[Piece], list[dict[str, Any]]]:
        return self._stream.finish(), self._stream.tool_calls


class _Plain:
    def __init__(self, tools: list[dict[str, Any]] | None) -> None:
        self._calls = ToolCallStream(tools) if tools is not None else None

    def feed(self, text: str) -> list[Piece]:
        text = self._calls.feed(text) if self._calls is not None else text
        return [("content", text)] if text else []

    def finish(self) -> tuple[list[Piece], list[dict[str, Any]]]:
        if self._calls is None:
            return [], []
        rest = self._calls.finish()
        return ([("content", rest.content)] if rest.content else []), rest.tool_calls


def is_harmony(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "harmony", False))


def output_stream(tokenizer: Any, tools: list[dict[str, Any]] | None) -> OutputStream:
    """A reader for one streamed answer."""
    return _Harmony() if is_harmony(tokenizer) else _Plain(tools)


def parse_output(tokenizer: Any, text: str, tools: list[dict[str, Any]] | None) -> ParsedOutput:
    """A whole answer read: its content stays the text itself unless calls (or harmony's channels) were found."""
    if is_harmony(tokenizer):
        return parse_harmony(text)
    return parse_tool_calls(text, tools) if tools is not None else ParsedOutput(text)
