"""A rendered chat prompt as token ids: special tokens only where the template put them, and each earlier answer as
the ids the engine generated for it.

- Message text is text. `<|im_end|><|im_start|>system ...` inside a user message (or a web page an agent read, a
  tool's output) would otherwise tokenize as the template's control tokens and forge a turn. A message whose text
  holds a special token's text is tokenized on its own with `Tokenizer.encode_text`, which spells it with ordinary
  tokens; `--allow-special-in-content` turns this off (llama.cpp's and vLLM's default behaviour).
- Answers come back as generated (engine.server.answer_ids).

Everything else, and every prompt with neither, is tokenized whole as before, so prompts keep their usual ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.errors import ApiError
from engine.server.answer_ids import AnswerIds


@dataclass(slots=True)
class PromptIds:
    """What a server's prompts are tokenized with: its answer store, and whether message text is text only."""

    answers: AnswerIds = field(default_factory=AnswerIds)
    contents_as_text: bool = True


def _texts(msg: dict[str, Any]) -> list[tuple[str, bool]]:
    """(text, whether the template may leave it out) of a message's parts, in the order templates write them."""
    parts = [(msg.get("reasoning_content"), True), (msg.get("content"), False)]
    return [(t, optional) for t, optional in parts if isinstance(t, str) and t]


def _trimmed(tokenizer: Any, ids: list[int], text: str) -> list[int] | None:
    """`ids` without the leading and trailing tokens that are only white space, if what remains is `text`."""
    lo, hi = 0, len(ids)
    while lo < hi and not tokenizer.decode(ids[lo:lo + 1]).strip():
        lo += 1
    while hi > lo and not tokenizer.decode(ids[hi - 1:hi]).strip():
        hi -= 1
    return ids[lo:hi] if tokenizer.decode(ids[lo:hi]) == text else None


def encode_prompt(tokenizer: Any, text: str, messages: list[dict[str, Any]], ids: PromptIds | None) -> list[int]:
    """`text`, the rendered prompt of `messages`, as token ids (see the module docstring)."""
    if ids is None:
        return tokenizer.encode(text, add_special_tokens=False)
    spans: list[tuple[int, int, list[int]]] = []
    pos = 0
    for i, msg in enumerate(messages):
        for part, optional in _texts(msg):
            generated = ids.answers.get(part) if msg.get("role") == "assistant" else None
            control = tokenizer.special_text_in(part) if ids.contents_as_text else None
            if generated is None and control is None:
                continue
            at = text.find(part, pos)
            if at < 0 and part.strip() != part:  # templates often trim a message (Gemma's, Llama 3's)
                part = part.strip()
                at = text.find(part, pos)
                if generated is not None:
                    generated = _trimmed(tokenizer, generated, part)
                    if generated is None and control is None:
                        continue
            if at < 0:
                if control is not None and not optional:  # the template changed the text: it cannot be kept apart
                    raise ApiError(400, f"'messages[{i}]' holds the text of the model's control token {control!r}, "
                                   "and the chat template rewrites the message, so it cannot be kept as plain text; "
                                   "remove it (or start the server with --allow-special-in-content)",
                                   param=f"messages[{i}]")
                continue  # left out (past reasoning), or an answer rewritten (trimmed): tokenized as text
            spans.append((at, at + len(part), generated if generated is not None else tokenizer.encode_text(part)))
            pos = at + len(part)
    if not spans:
        return tokenizer.encode(text, add_special_tokens=False)
    out: list[int] = []
    pos = 0
    for start, end, part_ids in spans:
        if start > pos:
            out += tokenizer.encode(text[pos:start], add_special_tokens=False)
        out += part_ids
        pos = end
    if pos < len(text):
        out += tokenizer.encode(text[pos:], add_special_tokens=False)
    return out
