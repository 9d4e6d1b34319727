"""DeepSeek-V3's tool calls, as its chat templates teach them (R1 and its distills write V3's form):

- V3 / R1: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{ARGS}\n```<｜tool▁call▁end｜>
  ...<｜tool▁calls▁end｜>`;
- V3.1 and later: `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{ARGS}<｜tool▁call▁end｜>` inside the same section markers.

The markers use fullwidth bars and U+2581 (the tokenizer decodes them as text: engine.model.tokenizer's
RENDERED_MARKERS). The arguments must be a JSON object; anything else is not a call and stays text.
"""

from __future__ import annotations

import json
import re
from typing import Any

OPEN = "<｜tool▁calls▁begin｜>"
CLOSE = "<｜tool▁calls▁end｜>"
CALL_OPEN = "<｜tool▁call▁begin｜>"
CALL_CLOSE = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
MARKERS = (OPEN, CLOSE, CALL_OPEN, CALL_CLOSE, SEP)
_NAME = re.compile(r"[A-Za-z_][\w.\-]{0,127}")
# V3's body after the separator: the name on its own line, then the arguments in a json code fence (llama.cpp's
# tests show the closing fence right after the object as well as on its own line).
_FENCED = re.compile(r"([^\n`]+?)\s*\n\s*```(?:json)?\s*\n?(.*?)\s*```\s*", re.S)


def _object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # garbled, or nested deeper than Python's parser goes: stays text
        return None
    return value if isinstance(value, dict) else None


def deepseek_call(body: str) -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) of one call's text between `<｜tool▁call▁begin｜>` and `<｜tool▁call▁end｜>`, in either
    variant; None when it is not a call."""
    left, sep, right = body.partition(SEP)
    if not sep:
        return None
    fenced = _FENCED.fullmatch(right.strip()) if left.strip() == "function" else None
    if fenced is not None:  # V3: the call's type before the separator, the name after it
        name, arguments = fenced.group(1).strip(), _object(fenced.group(2))
    else:  # V3.1: the name before the separator, the bare object after it
        name, arguments = left.strip(), _object(right.strip())
    if arguments is None or not _NAME.fullmatch(name):
        return None
    return name, arguments


def _section_calls(section: str) -> list[tuple[str, dict[str, Any]]] | None:
    """The calls of one section (the text between its markers); None when any part of it is not a call."""
    calls = []
    parts = section.split(CALL_OPEN)
    if parts[0].strip():
        return None
    for i, part in enumerate(parts[1:], 1):
        body, closed, after = part.partition(CALL_CLOSE)
        found = deepseek_call(body)
        # only the section's last call may be left open (generation stopped at its end marker)
        if found is None or after.strip() or (not closed and i < len(parts) - 1):
            return None
        calls.append(found)
    return calls or None


def deepseek_blocks(text: str) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
    """The content of `text` without its well-formed call sections, and their calls in order; a section that is not
    calls stays in the content as written. A last section left open (generation stopped at its end) counts."""
    calls: list[tuple[str, dict[str, Any]]] = []
    kept: list[str] = []
    pos = 0
    while (start := text.find(OPEN, pos)) >= 0:
        end = text.find(CLOSE, start)
        stop = len(text) if end < 0 else end + len(CLOSE)
        found = _section_calls(text[start + len(OPEN):end if end >= 0 else len(text)])
        kept.append(text[pos:stop] if found is None else text[pos:start])
        calls += found or ()
        pos = stop
    kept.append(text[pos:])
    return "".join(kept), calls
