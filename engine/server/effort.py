"""The reasoning effort a request asks for, read from each API's own field, as one of low / medium / high (None: the
request did not say; the model's default applies). A model whose format has no effort (every one but harmony's)
ignores it, but a bad value is refused whichever model runs, so a client learns of its mistake at once.

- chat completions: `reasoning_effort`, OpenAI's values: "none" and "minimal" are read as "low" (harmony has
  nothing lower), "xhigh" and "max" as "high";
- Responses: `reasoning.effort` (the same values);
- Messages: `output_config.effort` (low, medium, high; xhigh and max are high); without it `thinking`:
  {"type": "disabled"} is low, {"type": "enabled", "budget_tokens": N} is low below 2,048 tokens, medium below
  8,192 and high from there (Anthropic's budgets start at 1,024); "adaptive" and "between_tools" leave it to the model.
"""

from __future__ import annotations

from typing import Any

from engine.errors import ApiError

EFFORTS = ("low", "medium", "high")
_OPENAI_EFFORTS = {"none": "low", "minimal": "low", "low": "low", "medium": "medium", "high": "high",
                   "xhigh": "high", "max": "high"}
BUDGET_MEDIUM, BUDGET_HIGH = 2048, 8192


def openai_effort(value: Any, param: str) -> str | None:
    """`reasoning_effort` (chat) or `reasoning.effort` (Responses)."""
    if value is None:
        return None
    if not isinstance(value, str) or value not in _OPENAI_EFFORTS:
        raise ApiError(400, f"'{param}': expected one of {', '.join(_OPENAI_EFFORTS)}, got {value!r}"[:300],
                       param=param)
    return _OPENAI_EFFORTS[value]


def responses_effort(reasoning: dict[str, Any] | None) -> str | None:
    return openai_effort((reasoning or {}).get("effort"), "reasoning.effort")


_ANTHROPIC_EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}
assert set(_OPENAI_EFFORTS.values()) == set(_ANTHROPIC_EFFORTS.values()) == set(EFFORTS)
_THINKING_TYPES = ("enabled", "disabled", "adaptive", "between_tools")


def messages_effort(thinking: dict[str, Any] | None, output_config: dict[str, Any] | None) -> str | None:
    """Anthropic's `output_config.effort`, else its `thinking` object, as an effort."""
    value = (output_config or {}).get("effort")
    if value is not None:
        if not isinstance(value, str) or value not in _ANTHROPIC_EFFORTS:
            raise ApiError(400, f"'output_config.effort': expected one of {', '.join(_ANTHROPIC_EFFORTS)}, got "
                           f"{value!r}"[:300], param="output_config.effort")
        return _ANTHROPIC_EFFORTS[value]
    return thinking_effort(thinking)


def thinking_effort(thinking: dict[str, Any] | None) -> str | None:
    """Anthropic's `thinking` object as an effort."""
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind not in _THINKING_TYPES:
        raise ApiError(400, f"'thinking.type': expected one of {', '.join(_THINKING_TYPES)}, got {kind!r}"[:300],
                       param="thinking.type")
    if kind == "disabled":
        return "low"
    if kind != "enabled":
        return None
    budget = thinking.get("budget_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise ApiError(400, f"'thinking.budget_tokens': expected a whole number of tokens >= 1 with "
                       f"\"type\": \"enabled\", got {budget!r}"[:300], param="thinking.budget_tokens")
    return "low" if budget < BUDGET_MEDIUM else "medium" if budget < BUDGET_HIGH else "high"


# Whether a request turns the model's thinking on or off (None: it does not say), for a template with such a switch
# (engine.model.thinking). Only what an API states outright counts: OpenAI's effort "none" is off (no other effort
# says on or off), Anthropic's `thinking` type "disabled" is off and "enabled" on. Values are checked by the effort
# readers above.
def openai_thinking(value: Any) -> bool | None:
    """From `reasoning_effort` (chat) or `reasoning.effort` (Responses)."""
    return False if value == "none" else None


def messages_thinking(thinking: dict[str, Any] | None) -> bool | None:
    """From Anthropic's `thinking` object."""
    kind = (thinking or {}).get("type")
    return False if kind == "disabled" else True if kind == "enabled" else None
