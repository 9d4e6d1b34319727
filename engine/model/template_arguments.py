"""Past tool calls' arguments as chat templates need them: an object every template can serialise its own way
(`| tojson`, `.items()`), which DeepSeek-V3's template can also join to its strings as JSON text."""

from __future__ import annotations

import json
from typing import Any


class JsonArguments(dict[str, Any]):
    """A call's arguments that stay an object for templates that serialise them (`| tojson`, `.items()`) and join a
    string as their JSON text, as DeepSeek-V3's template writes them (`'```json' + arguments + ...`)."""

    def __add__(self, other: object) -> str:
        if not isinstance(other, str):
            return NotImplemented
        return json.dumps(self, ensure_ascii=False) + other

    def __radd__(self, other: object) -> str:
        if not isinstance(other, str):
            return NotImplemented
        return other + json.dumps(self, ensure_ascii=False)


def _arguments_object(arguments: Any) -> Any:
    # The Responses API passes past arguments as the JSON text the model wrote, the other two as objects: one kind
    # for every template (one that writes `arguments | tojson` would quote the text a second time).
    value = arguments
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except (ValueError, RecursionError):  # not JSON: the template gets the text as it is
            return arguments
    return JsonArguments(value) if isinstance(value, dict) else arguments


def with_joinable_arguments(message: dict) -> dict:
    """`message` with each past call's arguments as a JsonArguments object where they are (or read as) one."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and "arguments" in function:
            call = {**call, "function": {**function, "arguments": _arguments_object(function["arguments"])}}
        out.append(call)
    return {**message, "tool_calls": out}
