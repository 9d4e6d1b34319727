"""Whether a model thinks before it answers, and how its output marks the thought; decided once per model (at load,
and again when --chat-template replaces its template) from its vocabulary and chat template, never from the text of
an answer.

- `<think> ... </think>`: Qwen3, QwQ, DeepSeek-R1 and V3.1, GLM-4.x, SmolLM3 (both markers are tokens of their
  vocabulary and their template writes `</think>`);
- Gemma 4's thought channel, `<|channel>thought ... <channel|>`.

Some templates open the thought in the generation prompt themselves (DeepSeek-R1's ends with `<think>\\n`, V3.1's
with thinking on), so the output starts inside it and only the close marker appears; which way a template writes its
prompt is read by rendering a one-message conversation, with `enable_thinking` unset, false and true where the
template reads that switch. (gpt-oss's harmony is its own format: engine.server.harmony.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# (what opens the thought in output, what closes it, the token that begins the opening marker)
_FORMATS = (("<think>", "</think>", "<think>"), ("<|channel>thought", "<channel|>", "<|channel>"))
SWITCH = "enable_thinking"  # the template variable Qwen3, DeepSeek-V3.1, GLM-4.x and Gemma 4 read
MARKER_TOKENS = frozenset(token for _, close, token in _FORMATS for token in (token, close))
_PROBE = [{"role": "user", "content": "Hi"}]


@dataclass(frozen=True, slots=True)
class Thinking:
    """A model's thought markers, and where its generation prompt leaves the output: inside the thought or not."""

    open: str
    close: str
    switch: bool  # the template reads `enable_thinking`
    opens_by_default: bool  # the generation prompt ends inside the thought with the switch unset...
    opens_on: bool  # ...with it true
    opens_off: bool  # ...with it false

    def starts_inside(self, enable: bool | None) -> bool:
        """Whether the output begins inside the thought, for a request that set the switch (True / False) or not."""
        if enable is None or not self.switch:
            return self.opens_by_default
        return self.opens_on if enable else self.opens_off


def detect_thinking(tokenizer: Any) -> Thinking | None:
    """The model's thought markers, or None when it has none (its output is all answer)."""
    if getattr(tokenizer, "harmony", False):
        return None
    template = tokenizer.chat_template or ""
    for open_, close, first in _FORMATS:
        in_vocabulary = all(tokenizer.backend.token_to_id(t) is not None for t in (first, close))
        if not in_vocabulary or close not in template:
            continue
        switch = SWITCH in template
        return Thinking(open_, close, switch, _prompt_opens(tokenizer, open_, close, {}),
                        switch and _prompt_opens(tokenizer, open_, close, {SWITCH: True}),
                        switch and _prompt_opens(tokenizer, open_, close, {SWITCH: False}))
    return None


def _prompt_opens(tokenizer: Any, open_: str, close: str, extra: dict[str, Any]) -> bool:
    """Whether the generation prompt the template appends leaves an opened thought unclosed."""
    try:
        without = tokenizer.render_chat(_PROBE, add_generation_prompt=False, **extra)
        with_prompt = tokenizer.render_chat(_PROBE, add_generation_prompt=True, **extra)
    except Exception:  # noqa: BLE001 - a template that refuses this conversation has no prompt to read here
        return False
    suffix = with_prompt[len(without):] if with_prompt.startswith(without) else with_prompt
    return suffix.rfind(open_) > suffix.rfind(close)
