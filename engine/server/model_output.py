"""A model's output as every API route reads it: reasoning, answer text and tool calls, whole or as it streams.

A harmony model (engine.server.harmony) marks all three; a thinking model (engine.model.thinking) marks its thought,
the rest being answer text; any other model's output is answer text. Tool calls in a family's form
(engine.server.tool_calls) are read from the answer text only (a call inside a thought is thought, never run), and
only when tools were offered.
"""

from __future__ import annotations

from typing import Any, Protocol

from engine.server.harmony import HarmonyStream, Piece, parse_harmony
from engine.server.thoughts import ThoughtStream
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


class _Thinking:
    """A thinking model's output: its thought split off first, the answer text then read as _Plain reads it."""

    def __init__(self, thoughts: ThoughtStream, tools: list[dict[str, Any]] | None) -> None:
        self._thoughts = thoughts
        self._answer = _Plain(tools)

    def feed(self, text: str) -> list[Piece]:
        return self._split(self._thoughts.feed(text))

    def finish(self) -> tuple[list[Piece], list[dict[str, Any]]]:
        out = self._split(self._thoughts.finish())
        rest, calls = self._answer.finish()
        return out + rest, calls

    def _split(self, pieces: list[Piece]) -> list[Piece]:
        out: list[Piece] = []
        for kind, text in pieces:
            out.extend(self._answer.feed(text) if kind == "content" else [(kind, text)])
        return out


def is_harmony(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "harmony", False))


def output_stream(tokenizer: Any, tools: list[dict[str, Any]] | None, in_thought: bool = False) -> OutputStream:
    """A reader for one streamed answer; `in_thought`: the prompt opened the model's thought
    (RenderedPrompt.in_thought)."""
    if is_harmony(tokenizer):
        return _Harmony()
    thinking = getattr(tokenizer, "thinking", None)
    return _Plain(tools) if thinking is None else _Thinking(ThoughtStream(thinking, in_thought), tools)


def parse_output(tokenizer: Any, text: str, tools: list[dict[str, Any]] | None,
                 in_thought: bool = False) -> ParsedOutput:
    """A whole answer read: its content stays the text itself unless calls (or harmony's channels, or a thinking
    model's thought) were found."""
    if is_harmony(tokenizer):
        return parse_harmony(text)
    if getattr(tokenizer, "thinking", None) is None:
        return parse_tool_calls(text, tools) if tools is not None else ParsedOutput(text)
    reader = output_stream(tokenizer, tools, in_thought)
    pieces = reader.feed(text)
    rest, calls = reader.finish()
    reasoning = "".join(t for kind, t in pieces + rest if kind == "reasoning")
    content = "".join(t for kind, t in pieces + rest if kind == "content")
    if calls:
        return ParsedOutput(content.strip() or None, calls, reasoning or None)
    return ParsedOutput(content, [], reasoning or None)
