"""gpt-oss's harmony output read back, incrementally: each message is `<|start|>ROLE [to=RECIPIENT]<|channel|>CHANNEL
[to=RECIPIENT] [<|constrain|>json]<|message|>BODY` ended by `<|end|>`, `<|return|>` (the last answer) or `<|call|>`
(a tool call); generation begins after the prompt's `<|start|>assistant`, so the first header has no `<|start|>`.

- `analysis` bodies are the model's reasoning;
- `final` bodies, and `commentary` bodies without a recipient (preambles the user may read), are the answer;
- a body sent `to=functions.NAME` is the arguments of a call to NAME (another recipient, a built-in tool, keeps
  its whole name).

The decoder keeps harmony's markers as text (engine.model.tokenizer), while `<|return|>` and `<|call|>` end
generation and never reach the text; the stream's end closes the last message. Output with no message at all and
no marker (a model that ignores the format) is the answer; a header cut short by max_tokens is dropped.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from engine.model.tokenizer import HARMONY_TOKENS as TOKENS
from engine.server.tool_calls import ParsedOutput, new_call_id

START, CHANNEL, MESSAGE, END, RETURN, CALL, CONSTRAIN = TOKENS
_BODY_ENDS = (END, RETURN, CALL, START)  # START: a model that opens the next message without closing this one
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
_MARKERS = re.compile("|".join(map(re.escape, TOKENS)))

Kind = Literal["reasoning", "content"]
Piece = tuple[Kind, str]


def _append(out: list[Piece], kind: Kind, text: str) -> None:
    if not text:
        return
    if out and out[-1][0] == kind:
        out[-1] = (kind, out[-1][1] + text)
    else:
        out.append((kind, text))


def _partial_marker(text: str) -> int:
    """Length of the suffix of `text` that may be a marker still arriving (`<|`, `<|en`), held back until it is known."""
    at = text.rfind("<", max(0, len(text) - 12))
    if at < 0:
        return 0
    tail = text[at:]
    return len(tail) if any(m.startswith(tail) for m in TOKENS) else 0


class HarmonyStream:
    """Reads harmony output as it arrives: `feed` returns the reasoning and answer text that is certain so far, in
    order; `finish` the rest, after which `tool_calls` holds the calls (OpenAI's form)."""

    def __init__(self) -> None:
        self._buf = ""
        self._in_body = False
        self._kind: Kind | None = None  # where the open body goes; None: it is a call's arguments
        self._recipient = ""
        self._args: list[str] = []
        self._opened = False  # a message has begun: the output is harmony's
        self.tool_calls: list[dict[str, Any]] = []

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        out: list[Piece] = []
        while self._buf:
            if not self._in_body:
                at = self._buf.find(MESSAGE)
                if at < 0:
                    break  # the header is still arriving
                self._open(self._buf[:at])
                self._buf = self._buf[at + len(MESSAGE):]
                continue
            ends = [(i, m) for m in _BODY_ENDS if (i := self._buf.find(m)) >= 0]
            if not ends:
                keep = _partial_marker(self._buf)
                self._body(out, self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                break
            at, marker = min(ends)
            self._body(out, self._buf[:at])
            self._close()
            # the next header starts here; a START that ended the body is part of it
            self._buf = self._buf[at:] if marker == START else self._buf[at + len(marker):]
        return out

    def finish(self) -> list[Piece]:
        """What is left once generation ended (its last message closes here)."""
        out: list[Piece] = []
        rest, self._buf = self._buf, ""
        if self._in_body:
            self._body(out, rest)
            self._close()
        elif not self._opened and not _MARKERS.search(rest):
            _append(out, "content", rest.strip())  # a model ignoring the format: its text is the answer
        # else: a header that max_tokens cut short, nothing of its message was said
        return out

    def _open(self, header: str) -> None:
        found = _RECIPIENT.search(header)
        self._recipient = found.group(1) if found else ""
        channel = _CHANNEL.search(header)
        name = channel.group(1) if channel else "final"
        self._kind = None if self._recipient and self._recipient != "assistant" else \
            "reasoning" if name == "analysis" else "content"
        self._in_body = self._opened = True

    def _body(self, out: list[Piece], text: str) -> None:
        if self._kind is None:
            self._args.append(text)
        else:
            _append(out, self._kind, text)

    def _close(self) -> None:
        if self._kind is None:
            arguments = "".join(self._args).strip() or "{}"
            name = self._recipient.removeprefix("functions.")
            self.tool_calls.append({"id": new_call_id(), "type": "function",
                                    "function": {"name": name, "arguments": arguments}})
        self._args = []
        self._in_body = False


def message_bodies(tokenizer: Any, ids: list[int]) -> list[list[int]]:
    """The token ids of each message body in generated harmony output: what follows a `<|message|>` up to the token
    that ends it (those a client sends back as reasoning or answer text, to be prompted with the same ids)."""
    marker = {t: tokenizer.backend.token_to_id(t) for t in (MESSAGE, *_BODY_ENDS)}
    ends = {marker[t] for t in _BODY_ENDS}
    out: list[list[int]] = []
    body: list[int] | None = None
    for token in ids:
        if token == marker[MESSAGE]:
            body = []
        elif body is not None and token in ends:
            out.append(body)
            body = None
        elif body is not None:
            body.append(token)
    if body:
        out.append(body)
    return [b for b in out if b]


def reasoning_tokens(tokenizer: Any, ids: list[int]) -> int:
    """How many of the generated `ids` are `analysis` bodies (the usage's reasoning tokens)."""
    marker = {t: tokenizer.backend.token_to_id(t) for t in (CHANNEL, MESSAGE, *_BODY_ENDS)}
    ends = {marker[t] for t in _BODY_ENDS}
    count = 0
    header: list[int] = []
    analysis: bool | None = None  # None: in a header
    for token in ids:
        if analysis is None:
            if token == marker[CHANNEL]:
                header = []
            elif token == marker[MESSAGE]:
                analysis = tokenizer.decode(header).split()[:1] == ["analysis"]
            else:
                header.append(token)
        elif token in ends:
            analysis, header = None, []
        elif analysis:
            count += 1
    return count


def parse_harmony(text: str) -> ParsedOutput:
    """A whole harmony answer: its reasoning, its answer text (None when it only calls tools) and its calls."""
    stream = HarmonyStream()
    pieces = stream.feed(text) + stream.finish()
    reasoning = "".join(t for kind, t in pieces if kind == "reasoning")
    content = "".join(t for kind, t in pieces if kind == "content")
    if stream.tool_calls:
        return ParsedOutput(content.strip() or None, stream.tool_calls, reasoning or None)
    return ParsedOutput(content, [], reasoning or None)
