"""Gemma 4's tool calls, `<|tool_call>call:NAME{KEY:VALUE,...}<tool_call|>`, as its chat template teaches them.

A value is a string between `<|"|>` marks (taken as it is: no escapes), a number, true, false, null, a list
`[v,...]` or an object `{key:v,...}` whose keys are bare words; white space may follow a comma or an opening
bracket (llama.cpp's gemma4 grammar). Anything else is not a call and stays text.
"""

from __future__ import annotations

import json
import re
from typing import Any

OPEN = "<|tool_call>"
CLOSE = "<tool_call|>"
QUOTE = '<|"|>'
_PREFIX = "call:"
_NAME = re.compile(r"[A-Za-z_][\w.\-]{0,127}")
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_WORDS = {"true": True, "false": False, "null": None}
_KEY = re.compile(r"[^:}]+")
MAX_DEPTH = 64  # deeper nesting is not a call (and never a recursion error)


class _NotACall(ValueError):
    pass


class _Reader:
    def __init__(self, text: str) -> None:
        self.text, self.at = text, 0

    def space(self) -> None:
        while self.at < len(self.text) and self.text[self.at] in " \t\r\n":
            self.at += 1

    def take(self, literal: str) -> bool:
        if self.text.startswith(literal, self.at):
            self.at += len(literal)
            return True
        return False

    def value(self, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise _NotACall("too deep")
        if self.take(QUOTE):
            end = self.text.find(QUOTE, self.at)
            if end < 0:
                raise _NotACall("an unclosed string")
            out, self.at = self.text[self.at:end], end + len(QUOTE)
            return out
        if self.take("{"):
            return self.members(depth + 1)
        if self.take("["):
            return self.elements(depth + 1)
        for word, value in _WORDS.items():
            if self.take(word):
                return value
        number = _NUMBER.match(self.text, self.at)
        if number is None:
            raise _NotACall(f"no value at {self.at}")
        self.at = number.end()
        return json.loads(number.group(0))

    def members(self, depth: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        self.space()
        if self.take("}"):
            return out
        while True:
            key = _KEY.match(self.text, self.at)
            if key is None or not self.text.startswith(":", key.end()):
                raise _NotACall(f"no key at {self.at}")
            self.at = key.end() + 1
            self.space()
            out[key.group(0).strip()] = self.value(depth)
            self.space()
            if self.take("}"):
                return out
            if not self.take(","):
                raise _NotACall(f"expected , or }} at {self.at}")
            self.space()

    def elements(self, depth: int) -> list[Any]:
        out: list[Any] = []
        self.space()
        if self.take("]"):
            return out
        while True:
            out.append(self.value(depth))
            self.space()
            if self.take("]"):
                return out
            if not self.take(","):
                raise _NotACall(f"expected , or ] at {self.at}")
            self.space()


def gemma4_call(body: str) -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) of one call's `call:NAME{...}` (the text between the markers); None when it is not one."""
    body = body.strip()
    if not body.startswith(_PREFIX):
        return None
    name = _NAME.match(body, len(_PREFIX))
    if name is None or not body.startswith("{", name.end()):
        return None
    reader = _Reader(body)
    reader.at = name.end() + 1
    try:
        arguments = reader.members(1)
    except _NotACall:
        return None
    return (name.group(0), arguments) if reader.at == len(body) else None


def gemma4_blocks(text: str) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
    """The content of `text` without its well-formed call blocks, and their calls in order; a block that is not a
    call stays in the content as written. A last block left open (generation stopped at its end marker) counts."""
    calls: list[tuple[str, dict[str, Any]]] = []
    kept: list[str] = []
    pos = 0
    while (start := text.find(OPEN, pos)) >= 0:
        end = text.find(CLOSE, start)
        stop = len(text) if end < 0 else end + len(CLOSE)
        found = gemma4_call(text[start + len(OPEN):end if end >= 0 else len(text)])
        kept.append(text[pos:stop] if found is None else text[pos:start])
        if found is not None:
            calls.append(found)
        pos = stop
    kept.append(text[pos:])
    return "".join(kept), calls
