"""Tool calls written as Python calls, `[get_weather(city="Paris"), get_time(zone="CET")]` (LFM2 and LFM2-MoE,
between `<|tool_call_start|>` and `<|tool_call_end|>`; the markers are control tokens the decoder may leave out).

Read with Python's own parser (`ast`), never run: only a list of calls (or one call) whose callee is a name or a
dotted name and whose arguments are keywords with literal values (JSON's true/false/null accepted) becomes calls;
anything else is not a call and stays text.
"""

from __future__ import annotations

import ast
from typing import Any

OPEN = "<|tool_call_start|>"
CLOSE = "<|tool_call_end|>"
_JSON_NAMES = {"true": True, "false": False, "null": None}
MAX_CHARS = 1 << 20  # a longer "call" is not parsed (Python's parser on megabytes of nesting is not worth it)


def pythonic_calls(text: str) -> list[tuple[str, dict[str, Any]]] | None:
    """[(name, arguments)] of `[f(a=1), g(b="x")]` or `f(a=1)`; None when `text` is not such calls."""
    text = text.strip()
    if not text or len(text) > MAX_CHARS:
        return None
    try:
        body = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    nodes = body.elts if isinstance(body, ast.List) else [body]
    calls = []
    for node in nodes:
        if not isinstance(node, ast.Call) or node.args or not _is_name(node.func):
            return None
        arguments: dict[str, Any] = {}
        for keyword in node.keywords:
            if keyword.arg is None:  # **kwargs
                return None
            try:
                arguments[keyword.arg] = _literal(keyword.value)
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                return None
        calls.append((ast.unparse(node.func), arguments))
    return calls or None


def _is_name(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) or (isinstance(node, ast.Attribute) and _is_name(node.value))


def _literal(node: ast.expr) -> Any:
    """A literal's value, JSON's true/false/null read as Python's True/False/None (models write either)."""
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("** in a dict literal")
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values, strict=True) if k is not None}
    return ast.literal_eval(node)
