"""Whether a model thinks before it answers, and how its output marks the thought; decided once per model (at load,
and again when --chat-template replaces its template) from its vocabulary and chat template, never from the text of
an answer.

- `<think> ... </think>`: Qwen3, QwQ, DeepSeek-R1 and V3.1, GLM-4.x, SmolLM3 (both markers are tokens of their
  vocabulary and their template writes `</think>`);
- Gemma 4's thought channel, `<|channel>thought ... <channel|>`.

Some templates open the thought in the generation prompt themselves (DeepSeek-R1's ends with `<think>\n`; V3.1's
with its `thinking` variable true; Qwen3's unless `enable_thinking` is false), so the output starts inside it and only
the close marker appears. Which variable switches a template's thinking is read from the template (`enable_thinking`,
as Qwen3, GLM-4.x and Gemma 4 name it, or `thinking`, as DeepSeek-V3.1 does); where a request's prompt leaves the
output is read per request from the generation prompt its own conversation was rendered with (`prompt_opens`), so
a variable the request sets (its own `thinking`, say) and the message the conversation ends with (a tool result,
after which R1's template opens no thought) count as the template reads them.
(gpt-oss's harmony is its own format: engine.server.harmony.)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# (what opens the thought in output, what closes it, the token that begins the opening marker)
_FORMATS = (("<think>", "</think>", "<think>"), ("<|channel>thought", "<channel|>", "<|channel>"))
# The variables templates switch thinking with, in the order they are looked for: Qwen3's, GLM-4.x's and Gemma 4's;
# DeepSeek-V3.1's.
SWITCHES = ("enable_thinking", "thinking")
MARKER_TOKENS = frozenset(token for _, close, token in _FORMATS for token in (token, close))


@dataclass(frozen=True, slots=True)
class Thinking:
    """A model's thought markers, and the variable its template switches thinking with (None: it has none)."""

    open: str
    close: str
    switch: str | None


def detect_thinking(tokenizer: Any) -> Thinking | None:
    """The model's thought markers, or None when it has none (its output is all answer)."""
    if getattr(tokenizer, "harmony", False):
        return None
    template = tokenizer.chat_template or ""
    for open_, close, first in _FORMATS:
        in_vocabulary = all(tokenizer.backend.token_to_id(t) is not None for t in (first, close))
        if not in_vocabulary or close not in template:
            continue
        # A word of the template's source: a string that merely mentions it only costs a variable nothing reads.
        switch = next((name for name in SWITCHES if re.search(rf"(?<![\w.]){name}(?!\w)", template)), None)
        return Thinking(open_, close, switch)
    return None


def prompt_opens(thinking: Thinking, without: str, with_prompt: str) -> bool:
    """Whether the generation prompt a template appended leaves an opened thought unclosed, the output then
    starting inside it: `without` and `with_prompt` are the request's own conversation rendered without and with
    the generation prompt (templates write it after some messages only: DeepSeek-R1's opens no thought after a
    tool result, V3.1's only after a user message)."""
    suffix = with_prompt[len(without):] if with_prompt.startswith(without) else with_prompt
    return suffix.rfind(thinking.open) > suffix.rfind(thinking.close)
