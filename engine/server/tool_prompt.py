"""Tools for a model whose chat template cannot show them (the bundled SmolLM2's, many base fine-tunes'): the tool
list goes into the system message, past calls into the assistant's text and tool results into user turns, all in
the Hermes `<tool_call>` form that engine.server.tool_calls parses back. A template that renders `tools` itself is
left to do so."""

from __future__ import annotations

import json
from typing import Any

INSTRUCTIONS = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def template_renders_tools(template: str) -> bool:
    """Whether a chat template reads the `tools` variable (a template that never names it drops them)."""
    return "tools" in template


def arguments_object(arguments: Any) -> Any:
    # Chat templates (Qwen, Hermes, Llama 3) serialise arguments themselves and expect an object, while
    # OpenAI clients send the JSON text the model produced.
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except (ValueError, RecursionError):  # not JSON, or nested deeper than Python's parser goes
            return arguments
    return {} if arguments is None else arguments


def _call_text(call: dict[str, Any]) -> str:
    """A past call as the model is told to write one: its arguments an object, whether the API gave them as one
    (Chat, Messages) or as the JSON text the model wrote (Responses), never that text quoted again."""
    function = call["function"]
    return "<tool_call>\n" + json.dumps({"name": function["name"], "arguments": arguments_object(function["arguments"])},
                                        ensure_ascii=False) + "\n</tool_call>"


def inline_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """`messages` with the tools and every past call and result written as text any template renders."""
    listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools or [])
    out: list[dict[str, Any]] = []
    if tools:
        block = INSTRUCTIONS.format(tools=listing)
        if messages and messages[0]["role"] == "system":
            out.append({**messages[0], "content": messages[0]["content"] + "\n\n" + block})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": block})
    for msg in messages:
        if msg["role"] == "assistant" and msg.get("tool_calls"):
            calls = "\n".join(_call_text(call) for call in msg["tool_calls"])
            text = (msg.get("content") or "") + ("\n" if msg.get("content") else "") + calls
            out.append({k: v for k, v in msg.items() if k != "tool_calls"} | {"content": text})
        elif msg["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{msg['content']}\n</tool_response>"})
        else:
            out.append(msg)
    return out


DEEPSEEK_INSTRUCTIONS = """## Tools
You have access to the following tools:
{tools}
IMPORTANT: ALWAYS adhere to this exact format for tool use:
<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{example}<｜tool▁call▁end｜>{{additional_tool_calls}}<｜tool▁calls▁end｜>

Where:
- `tool_call_name` must be an exact match to one of the available tools
- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema
- For multiple tool calls, chain them directly without separators or spaces"""
V31_EXAMPLE = "tool_call_name<｜tool▁sep｜>tool_call_arguments"
V3_EXAMPLE = "function<｜tool▁sep｜>tool_call_name\n```json\ntool_call_arguments\n```"


def template_writes_deepseek_calls(template: str) -> bool:
    """Whether a chat template writes past calls in DeepSeek-V3's markers (and results in its own): such templates
    (V3's, V3.1's, R1's) never show the tool list, which DeepSeek's model cards put in the system turn."""
    return "<｜tool▁call▁begin｜>" in template


def deepseek_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                   template: str) -> list[dict[str, Any]]:
    """`messages` with the tool list in the system turn in the form DeepSeek-V3.1's model card gives, showing calls
    in the form `template` writes them (V3's fenced JSON or V3.1's bare object); past calls and results are left
    to the template."""
    if not tools:
        return messages
    listing = ""
    for tool in tools:
        function = tool.get("function") or {}
        listing += (f"\n### {function.get('name', '')}\nDescription: {function.get('description', '')}\n\n"
                    f"Parameters: {json.dumps(function.get('parameters') or {}, ensure_ascii=False)}\n")
    example = V3_EXAMPLE if "```json" in template else V31_EXAMPLE
    block = DEEPSEEK_INSTRUCTIONS.format(tools=listing, example=example)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + block}, *messages[1:]]
    return [{"role": "system", "content": block}, *messages]
