"""A chat in gpt-oss's harmony format, written here rather than by the model's chat template: the reasoning effort
comes from the request, tool calls are written back as the model generated them, and which past reasoning is left
out is known (and reported in /cache/requests).

- system: the model's identity, dates, `Reasoning: low|medium|high` and the valid channels;
- developer: the request's system/developer messages as `# Instructions`, then the tools as TypeScript-like
  signatures in `namespace functions`;
- an assistant turn: its reasoning on `analysis`, text that came with calls as a `commentary` preamble, each call
  as `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>` (the model's own form, so
  the prompt continues the tokens the cache holds), and an answer on `final` ended by `<|end|>` (harmony's rule:
  the `<|return|>` it was generated with becomes `<|end|>`);
- a tool result: `<|start|>functions.NAME to=assistant<|channel|>commentary<|message|>OUTPUT<|end|>`.

Past reasoning follows harmony's rule: reasoning of a turn that ended in a final answer is left out; reasoning after
the last final answer (a tool loop still going) is kept.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from engine.server.effort import EFFORTS
from engine.server.harmony import CALL, CHANNEL, CONSTRAIN, END, MESSAGE, START

DEFAULT_EFFORT = "medium"  # gpt-oss's own default
KNOWLEDGE_CUTOFF = "2024-06"
IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."


@dataclass(slots=True)
class HarmonyPrompt:
    """The prompt text, and the reasoning of earlier turns as it was left out or kept (each as it would be written)."""

    text: str
    dropped: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)


def _message(role: str, body: str, channel: str | None = None) -> str:
    return f"{START}{role}" + (f"{CHANNEL}{channel}" if channel else "") + f"{MESSAGE}{body}{END}"


def _ts_type(schema: Any, indent: str) -> str:
    """A JSON schema as the TypeScript-like type harmony shows tools with."""
    if not isinstance(schema, dict):
        return "any"
    if "enum" in schema and isinstance(schema["enum"], list) and schema["enum"]:
        return " | ".join(json.dumps(v, ensure_ascii=False) for v in schema["enum"])
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return " | ".join(_ts_type(s, indent) for s in schema[key])
    kind = schema.get("type")
    if isinstance(kind, list):
        return " | ".join(_ts_type({**schema, "type": k}, indent) for k in kind)
    if kind == "string":
        return "string"
    if kind in ("number", "integer"):
        return "number"
    if kind == "boolean":
        return "boolean"
    if kind == "null":
        return "null"
    if kind == "array":
        return f"{_ts_type(schema.get('items'), indent)}[]"
    if kind == "object" and isinstance(schema.get("properties"), dict) and schema["properties"]:
        return "{\n" + _ts_fields(schema, indent + "  ") + indent + "}"
    if kind == "object":
        return "object"
    return "any"


def _ts_fields(schema: dict[str, Any], indent: str) -> str:
    required = set(schema.get("required") or [])
    lines = []
    for name, prop in schema["properties"].items():
        prop = prop if isinstance(prop, dict) else {}
        if isinstance(prop.get("description"), str) and prop["description"]:
            lines.append(f"{indent}// {prop['description']}")
        optional = "" if name in required else "?"
        default = f" // default: {json.dumps(prop['default'], ensure_ascii=False)}" if "default" in prop else ""
        lines.append(f"{indent}{name}{optional}: {_ts_type(prop, indent)},{default}")
    return "".join(line + "\n" for line in lines)


def tool_signatures(tools: list[dict[str, Any]]) -> str:
    """The developer message's `## functions` section: one commented type per offered function."""
    out = ["## functions\n\nnamespace functions {\n"]
    for tool in tools:
        function = tool.get("function") or {}
        if isinstance(function.get("description"), str) and function["description"]:
            out.append(f"// {function['description']}")
        params = function.get("parameters") or {}
        if isinstance(params.get("properties"), dict) and params["properties"]:
            out.append(f"type {function['name']} = (_: {{\n{_ts_fields(params, '')}}}) => any;\n")
        else:
            out.append(f"type {function['name']} = () => any;\n")
    out.append("} // namespace functions")
    return "\n".join(out)


def _system(effort: str, tools: bool, today: str) -> str:
    body = (f"{IDENTITY}\nKnowledge cutoff: {KNOWLEDGE_CUTOFF}\nCurrent date: {today}\n\nReasoning: {effort}\n\n"
            "# Valid channels: analysis, commentary, final. Channel must be included for every message.")
    if tools:
        body += "\nCalls to these tools must go to the commentary channel: 'functions'."
    return _message("system", body)


def _arguments(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _is_final(msg: dict[str, Any]) -> bool:
    return msg.get("role") == "assistant" and not msg.get("tool_calls")


def render_harmony(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, effort: str | None,
                   today: str | None = None) -> HarmonyPrompt:
    """The harmony prompt for messages in Hugging Face's chat-template form (roles system, user, assistant, tool),
    ending with the generation prompt `<|start|>assistant`."""
    effort = effort or DEFAULT_EFFORT
    assert effort in EFFORTS, effort  # the routes refuse other values with a 400
    today = today or datetime.now(UTC).strftime("%Y-%m-%d")
    instructions = [m["content"] for m in messages if m.get("role") in ("system", "developer") and m.get("content")]
    chat = [m for m in messages if m.get("role") not in ("system", "developer")]
    last_final = max((i for i, m in enumerate(chat) if _is_final(m)), default=-1)
    out = HarmonyPrompt(_system(effort, bool(tools), today))
    developer = [f"# Instructions\n\n{chr(10).join(instructions)}"] if instructions else []
    if tools:
        developer.append("# Tools\n\n" + tool_signatures(tools))
    if developer:
        out.text += _message("developer", "\n\n".join(developer))
    names: dict[str, str] = {}  # call id -> function name, for the tool results that answer them
    last_call = ""
    for i, msg in enumerate(chat):
        role = msg.get("role")
        if role == "user":
            out.text += _message("user", msg.get("content") or "")
        elif role == "tool":
            name = names.get(msg.get("tool_call_id") or "") or msg.get("name") or last_call or "tool"
            out.text += f"{START}functions.{name} to=assistant{CHANNEL}commentary{MESSAGE}{msg.get('content') or ''}{END}"
        elif role == "assistant":
            reasoning = msg.get("reasoning_content")
            if reasoning:
                written = _message("assistant", reasoning, "analysis")
                if i <= last_final:
                    out.dropped.append(written)
                else:
                    out.kept.append(written)
                    out.text += written
            calls = msg.get("tool_calls") or []
            content = msg.get("content") or ""
            if calls:
                if content:
                    out.text += _message("assistant", content, "commentary")
                for call in calls:
                    function = call.get("function") or {}
                    name = function.get("name") or ""
                    names[call.get("id") or ""] = last_call = name
                    out.text += (f"{START}assistant{CHANNEL}commentary to=functions.{name} {CONSTRAIN}json{MESSAGE}"
                                 f"{_arguments(function.get('arguments'))}{CALL}")
            else:
                out.text += _message("assistant", content, "final")
    out.text += f"{START}assistant"
    return out
