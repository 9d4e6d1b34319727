"""A thinking model's output split into its thought and its answer, as it streams (engine.model.thinking says which
markers a model writes and whether its prompt already opened the thought).

Whitespace the templates put around the markers (`<think>\\n`, `\\n</think>\\n\\n`, `<|channel>thought\\n`) belongs
to neither part and is dropped. Text that merely starts like a marker (`</thin` before it is known to be `</think>`
or `</thing>`) is held back until it is known, so a marker split across chunks is still one marker. A thought the
model never closes (max_tokens cut it) is all reasoning; once the first thought closes, later markers are answer
text (only the first thought is one), except an empty thought, which is dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.model.thinking import Thinking
from engine.server.harmony import Kind, Piece


def _held(text: str, marker: str) -> int:
    """Length of the suffix of `text` that may be the start of `marker`, still arriving."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ThoughtStream:
    """Reads a thinking model's output as it arrives: `feed` returns the reasoning and answer text certain so far,
    in order; `finish` the rest."""

    def __init__(self, thinking: Thinking, starts_inside: bool) -> None:
        self._open, self._close = thinking.open, thinking.close
        # before: the thought may still open; inside: in it; after: the rest is answer
        self._state = "inside" if starts_inside else "before"
        self._buf = ""
        self._lead = True  # at the start of a part: its leading whitespace is the template's, not the model's
        self._trail = ""  # whitespace at the thought's end, kept back in case the close marker follows it
        # the prompt opened the thought, and the model may open it again itself (its first text is the marker)
        self._may_reopen = starts_inside

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        out: list[Piece] = []
        while self._buf:
            if self._state == "before":
                if self._lead:
                    self._buf = self._buf.lstrip()
                if not self._buf:
                    break
                if self._buf.startswith(self._open):
                    self._buf = self._buf[len(self._open):]
                    self._state, self._lead = "inside", True
                    continue
                if self._open.startswith(self._buf):
                    break  # the marker may be arriving
                self._state = "after"  # the answer began without a thought
                continue
            if self._state == "after":
                if not self._answer(out):
                    break
                continue
            if self._may_reopen:
                start = self._buf.lstrip()
                if start.startswith(self._open):
                    self._buf = start[len(self._open):]
                elif start and self._open.startswith(start):
                    break  # the marker may be arriving
                elif not start:
                    break  # only whitespace so far
                self._may_reopen = False
                continue
            at = self._buf.find(self._close)
            if at >= 0:
                self._emit(out, "reasoning", self._buf[:at], closing=True)
                self._buf = self._buf[at + len(self._close):]
                self._state, self._lead, self._trail = "after", True, ""
                continue
            keep = _held(self._buf, self._close)
            self._emit(out, "reasoning", self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            break
        return out

    def _answer(self, out: list[Piece]) -> bool:
        """Answer text let through up to a possible empty thought, which is dropped (Gemma 4 may end its answer with
        one, as llama.cpp notes); False when the rest must wait for more text."""
        at = self._buf.find(self._open)
        if at < 0:
            keep = _held(self._buf, self._open)
            self._emit(out, "content", self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        self._emit(out, "content", self._buf[:at])
        self._buf = self._buf[at:]
        inner = self._buf[len(self._open):].lstrip()
        if inner.startswith(self._close):
            self._buf = inner[len(self._close):]
            return True
        if self._close.startswith(inner):
            return False  # it may still be an empty thought
        self._emit(out, "content", self._open)  # a thought with something in it, past the first: answer text
        self._buf = self._buf[len(self._open):]
        return True

    def finish(self) -> list[Piece]:
        """What is left once generation ended: a marker that never completed is text of the part it was in."""
        rest, self._buf = self._buf, ""
        out: list[Piece] = []
        if self._state == "inside":
            self._emit(out, "reasoning", rest, closing=True)
        else:
            self._emit(out, "content", rest)
        return out

    def _emit(self, out: list[Piece], kind: Kind, text: str, closing: bool = False) -> None:
        if self._lead:
            text = text.lstrip()
            if not text:
                return
            self._lead = False
        if kind == "reasoning":
            text = self._trail + text
            body = text.rstrip()
            self._trail = "" if closing else text[len(body):]
            text = body
        if text:
            if out and out[-1][0] == kind:
                out[-1] = (kind, out[-1][1] + text)
            else:
                out.append((kind, text))


def _span(tokenizer: Any, thinking: Thinking, ids: list[int], in_thought: bool) -> tuple[int, int, int, int] | None:
    """Where the thought lies in the generated `ids`: (its first token, the end of its tokens, the first token of
    the answer, the end of the output without its end-of-turn token); None when the output has no thought. The
    tokens between the thought's end and the answer's start are the close marker's: neither part's text, nor
    counted as the thought's (a token that holds the thought's last text and the marker's start is the thought's). Read from the decoded text, so a marker spelled in several tokens is found as one
    written as a single token is; an open marker the model writes after a prompt that opened the thought is the
    marker, not thought text."""
    stop = len(ids) - 1 if ids and ids[-1] in tokenizer.eos_token_ids else len(ids)

    def first(holds: Callable[[str], bool]) -> int:
        """The fewest leading ids whose text `holds` (once it holds, more ids keep it); stop + 1 if none do."""
        lo, hi = 0, stop + 1
        while lo < hi:
            mid = (lo + hi) // 2
            if mid <= stop and holds(tokenizer.decode(ids[:mid])):
                hi = mid
            else:
                lo = mid + 1
        return lo

    start = first(lambda text: text.lstrip().startswith(thinking.open))
    if start > stop:
        if not in_thought:
            return None  # the output does not begin with a thought
        start = 0
    before = len(tokenizer.decode(ids[:start]))
    at = tokenizer.decode(ids[:stop]).find(thinking.close, before)
    if at < 0:  # never closed (max_tokens): all thought
        return start, stop, stop, stop
    end = max(start, first(lambda text: len(text) >= at))  # the fewest ids that hold the thought's text
    return start, end, min(first(lambda text: thinking.close in text[before:]), stop), stop


def thought_tokens(tokenizer: Any, thinking: Thinking, ids: list[int], in_thought: bool) -> int:
    """How many of the generated `ids` are the thought's (the usage's reasoning tokens): those after the open marker
    (or from the start, when the prompt opened the thought) up to the close marker, whose own tokens are not
    counted."""
    span = _span(tokenizer, thinking, ids, in_thought)
    return 0 if span is None else span[1] - span[0]


def answer_parts(tokenizer: Any, thinking: Thinking, ids: list[int], in_thought: bool) -> list[list[int]]:
    """The generated ids of the thought and of the answer, apart and without the whitespace tokens around the
    markers: the texts a client sends back (as reasoning and as content), to be prompted with the ids that were
    generated for them (engine.server.answer_ids). The whole output when it has no thought."""
    span = _span(tokenizer, thinking, ids, in_thought)
    if span is None:
        return [ids]
    start, end, after, stop = span
    parts = (_trimmed(tokenizer, ids[start:end]), _trimmed(tokenizer, ids[after:stop]))
    return [part for part in parts if part]


def _trimmed(tokenizer: Any, ids: list[int]) -> list[int]:
    lo, hi = 0, len(ids)
    while lo < hi and not tokenizer.decode(ids[lo:lo + 1]).strip():
        lo += 1
    while hi > lo and not tokenizer.decode(ids[hi - 1:hi]).strip():
        hi -= 1
    return ids[lo:hi]
