"""The reasoning effort a request asks for, read from each API's own field, as one of low / medium / high (None: the
request did not say; the model's default applies). A model whose format has no effort (every one but harmony's)
ignores it, but a bad value is refused whichever model runs, so a client learns of its mistake at once.

- chat completions: `reasoning_effort` ("minimal" is read as "low": harmony has nothing lower);
- Responses: `reasoning.effort` (the same values);
- Messages: `thinking` — {"type": "disabled"} is low, {"type": "enabled", "budget_tokens": N} is low below 2,048
  tokens, medium below 8,192 and high from there (Anthropic's budgets start at 1,024).
"""

from __future__ import annotations

from typing import Any

from engine.errors import ApiError

EFFORTS = ("low", "medium", "high")
_OPENAI_VALUES = ("minimal", *EFFORTS)
BUDGET_MEDIUM, BUDGET_HIGH = 2048, 8192


def openai_effort(value: Any, param: str) -> str | None:
    """`reasoning_effort` (chat) or `reasoning.effort` (Responses)."""
    if value is None:
        return None
    if value not in _OPENAI_VALUES:
        raise ApiError(400, f"'{param}': expected one of {', '.join(_OPENAI_VALUES)}, got {value!r}"[:300],
                       param=param)
    return "low" if value == "minimal" else str(value)


def responses_effort(reasoning: dict[str, Any] | None) -> str | None:
    return openai_effort((reasoning or {}).get("effort"), "reasoning.effort")


def thinking_effort(thinking: dict[str, Any] | None) -> str | None:
    """Anthropic's `thinking` object as an effort."""
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind == "disabled":
        return "low"
    if kind != "enabled":
        raise ApiError(400, f"'thinking.type': expected \"enabled\" or \"disabled\", got {kind!r}"[:300],
                       param="thinking.type")
    budget = thinking.get("budget_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise ApiError(400, f"'thinking.budget_tokens': expected a whole number of tokens >= 1 with "
                       f"\"type\": \"enabled\", got {budget!r}"[:300], param="thinking.budget_tokens")
    return "low" if budget < BUDGET_MEDIUM else "medium" if budget < BUDGET_HIGH else "high"
