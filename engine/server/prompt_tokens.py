"""A rendered chat prompt as token ids: special tokens only where the template put them, and each earlier answer as
the ids the engine generated for it.

- Message text is text. `<|im_end|><|im_start|>system ...` inside a user message (or a web page an agent read, a
  tool's output) would otherwise tokenize as the template's control tokens and forge a turn. A message whose text
  holds a special token's text is tokenized on its own with `Tokenizer.encode_text`, which spells it with ordinary
  tokens; `--allow-special-in-content` turns this off (llama.cpp's and vLLM's default behaviour).
- Answers come back as generated (engine.server.answer_ids).
- An earlier answer (or its reasoning) that the client sent back but the template left out or rewrote is noted: the
  conversation's cache cannot be reused past it, and `/cache/requests` says the template, not the client, is why.

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


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    """A chat prompt's token ids, and the first token the template wrote otherwise than at the conversation's earlier
    turns (past reasoning left out, an answer or an earlier turn rewritten; None: the history is written as before,
    so the prompt goes on from the last turn's). The cache cannot reuse past it; /cache/requests then says why."""

    ids: list[int]
    rewritten_at: int | None = None
    # Earlier turns' reasoning the format left out or kept (harmony's rule), for /cache/requests; None: none was sent
    past_reasoning: dict[str, Any] | None = None
    in_thought: bool = False  # the prompt ends inside the model's opened thought (engine.model.thinking)


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


def encode_prompt(tokenizer: Any, text: str, messages: list[dict[str, Any]], ids: PromptIds | None
                  ) -> tuple[list[int], int | None]:
    """`text`, the rendered prompt of `messages`, as token ids (see the module docstring), and the character
    position after which the template left out or rewrote an earlier answer or its reasoning (None: none)."""
    if ids is None:
        return tokenizer.encode(text, add_special_tokens=False), None
    spans: list[tuple[int, int, list[int]]] = []
    pos = 0
    dropped: int | None = None
    for i, msg in enumerate(messages):
        assistant = msg.get("role") == "assistant"
        missing = False  # a part of this answer is not in the text: it was where the next part found begins
        for part, optional in _texts(msg):
            generated = ids.answers.get(part) if assistant else None
            control = tokenizer.special_text_in(part) if ids.contents_as_text else None
            if generated is None and control is None and not assistant:
                continue  # nothing to keep apart, nothing the cache holds as generated
            at = text.find(part, pos)
            if at < 0 and part.strip() != part:  # templates often trim a message (Gemma's, Llama 3's)
                part = part.strip()
                at = text.find(part, pos)
                if generated is not None:
                    generated = _trimmed(tokenizer, generated, part)
            if at < 0:
                if control is not None and not optional:  # the template changed the text: it cannot be kept apart
                    raise ApiError(400, f"'messages[{i}]' holds the text of the model's control token {control!r}, "
                                   "and the chat template rewrites the message, so it cannot be kept as plain text; "
                                   "remove it (or start the server with --allow-special-in-content)",
                                   param=f"messages[{i}]")
                missing = missing or assistant  # left out (past reasoning) or rewritten
                continue
            if missing and dropped is None:
                dropped = at
            if generated is not None or control is not None:
                spans.append((at, at + len(part), generated if generated is not None else tokenizer.encode_text(part)))
            pos = at + len(part)
        if missing and dropped is None:
            dropped = pos  # nothing of the answer is there: it was somewhere after what came before
    if not spans:
        return tokenizer.encode(text, add_special_tokens=False), dropped
    out: list[int] = []
    pos = 0
    for start, end, part_ids in spans:
        if start > pos:
            out += tokenizer.encode(text[pos:start], add_special_tokens=False)
        out += part_ids
        pos = end
    if pos < len(text):
        out += tokenizer.encode(text[pos:], add_special_tokens=False)
    return out, dropped
