"""A message's content as one string, for the OpenAI APIs: a string as is, or a list of content parts whose text
parts are joined by newlines. Chat Completions and Responses read parts the same way and differ only in the part
types they name (`CHAT_PARTS`, `RESPONSES_PARTS`); every refusal is a 400 naming the part at fault.

Media (images, audio, files) cannot be read by the text-only models served here. In the user message answered
they are refused; in any other message, and in a tool's output wherever it is, each becomes `omitted(kind)`
in the text instead: an agent resends its whole history every turn, and one screenshot a tool returned must not
make every later turn of the conversation fail."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.errors import ApiError


@dataclass(frozen=True, slots=True)
class PartKinds:
    """The content parts one API declares: those that carry text (by type, with the field the text is in) and
    those that carry media, refused as such (the model served here reads text only)."""

    text: dict[str, str]
    media: tuple[str, ...]
    example: str  # the text part named when a part is not one of these


CHAT_PARTS = PartKinds(text={"text": "text", "refusal": "refusal"}, media=("image_url", "input_audio", "file"),
                       example="text")
RESPONSES_PARTS = PartKinds(
    text={"input_text": "text", "output_text": "text", "text": "text", "summary_text": "text",
          "reasoning_text": "text", "refusal": "refusal"},
    media=("input_image", "input_file", "input_audio"), example="input_text")


def answered(kinds: list[str], asking: int) -> int:
    """`asking` (the index of the last user message, -1 for none) when that message is the one being answered:
    nothing but system messages follows it, and at most a final assistant's text (a prefill). In a tool loop
    (a call, its result, an answer after it) the question was answered already: -1, so its media too are
    omitted, not refused on every later turn. `kinds`: each message's role, or its item type for Responses."""
    after = kinds[asking + 1 :] if asking >= 0 else []
    if after and after[-1] == "assistant":
        after = after[:-1]
    return asking if all(kind in ("system", "developer") for kind in after) else -1


def omitted(kind: str) -> str:
    """What stands in the text for a media part or block of type `kind` that is not refused (the module says when)."""
    return f"[{kind} omitted: the model served here reads text only]"


def parts_text(content: Any, param: str, kinds: PartKinds, *, omit_media: bool = False) -> str:
    """`content` (a string, or a list of `kinds` parts) as one string: the parts' texts joined by newlines; a media
    part refused, or `omitted` with `omit_media`."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"'{param}': expected a string or a list of content parts, got {content!r}"[:200],
                       param=param)
    texts = []
    for i, part in enumerate(content):
        where = f"{param}[{i}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(kind, str) and kind in kinds.text:
            field = kinds.text[kind]
            value = part.get(field)
            if not isinstance(value, str):
                raise ApiError(400, f"'{where}.{field}': expected a string, got {value!r}"[:200],
                               param=f"{where}.{field}")
            texts.append(value)
        elif isinstance(kind, str) and kind in kinds.media and omit_media:
            texts.append(omitted(kind))
        elif isinstance(kind, str) and kind in kinds.media:
            raise ApiError(400, f"'{where}': {kind} parts are not supported: the model served here reads text only",
                           param=where)
        else:
            raise ApiError(400, f"'{where}': expected a content part like {{\"type\": \"{kinds.example}\", "
                           f"\"text\": \"...\"}}, got type {kind!r}"[:200], param=where)
    return "\n".join(texts)
