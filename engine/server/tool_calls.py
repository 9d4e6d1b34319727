"""Tool calls in model output turned into OpenAI `tool_calls`, in the formats the templates of the models we load
teach them:

- Hermes JSON, `<tool_call>{"name": ..., "arguments": ...}</tool_call>` (Qwen2/2.5/3, Hermes, SmolLM3, our ChatML);
- Qwen3-Coder / Qwen3.5 XML inside the same tags, `<tool_call><function=NAME><parameter=KEY>VALUE</parameter>
  </function></tool_call>` (a value is JSON where the tool's schema says it is not a string, or where it parses);
- Mistral, `[TOOL_CALLS][{"name": ..., "arguments": ...}]` or `[TOOL_CALLS]NAME[ARGS]{...}` (the markers may be
  control tokens the decoder leaves out: a whole answer that is such a JSON list counts too);
- Llama 3.x JSON, a whole answer `{"name": ..., "parameters": ...}` (after `<|python_tag|>` if any), taken only
  when it names an offered tool;
- GLM-4.x's keys and values inside the same tags, `<tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE
  </arg_value>...</tool_call>` (values read as the XML form's; a bare NAME only when it names an offered tool);
- LFM2's Python calls, `<|tool_call_start|>[NAME(KEY=VALUE, ...)]<|tool_call_end|>` (engine/server/pythonic_calls.py;
  without its markers, which are control tokens, a whole answer of such calls counts when every one names an
  offered tool);
- Gemma 4's, `<|tool_call>call:NAME{KEY:<|"|>text<|"|>,KEY:5}<tool_call|>` (engine/server/gemma4_calls.py);
- DeepSeek-V3's, `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```
  <｜tool▁call▁end｜><｜tool▁calls▁end｜>`, and V3.1's `...<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}...`
  (engine/server/deepseek_calls.py).

A call the model garbles stays in the content as text, never an error.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from engine.server import deepseek_calls as deepseek
from engine.server import gemma4_calls as gemma4
from engine.server import pythonic_calls as pythonic

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


@dataclass(slots=True)
class ParsedOutput:
    """Model output split into what the user reads and the calls the client should run."""

    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    reasoning: str | None = None  # what the model thought before answering, where its format marks it (harmony)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


MISTRAL = "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?(?:</parameter>|(?=<parameter=)|$)", re.S)
_GLM_KEY = "<arg_key>"
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)(?:</arg_value>|$)", re.S)
_GLM_NAME = re.compile(r"[A-Za-z_][\w.\-]{0,127}")

Schemas = dict[str, dict[str, Any]]  # tool name -> its JSON schema's properties


def schemas_of(tools: list[dict[str, Any]] | None) -> Schemas:
    """The offered function tools' parameter properties by name (what XML values are read against)."""
    out: Schemas = {}
    for tool in tools or []:
        function = tool.get("function") or {}
        if isinstance(function.get("name"), str):
            out[function["name"]] = ((function.get("parameters") or {}).get("properties") or {})
    return out


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # garbled, or nested deeper than Python's parser goes: stays text
        return None


def _call(name: str, arguments: Any) -> dict[str, Any]:
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def _json_call(obj: Any) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    return _call(obj["name"], obj.get("arguments", obj.get("parameters", {})))


def _xml_value(raw: str, schema: dict[str, Any] | None) -> Any:
    kind = (schema or {}).get("type")
    if kind == "string":
        return raw
    value = _loads(raw.strip())
    return raw if value is None and raw.strip() not in ("null",) else value


def _xml_calls(body: str, schemas: Schemas) -> list[dict[str, Any]]:
    calls = []
    for name, inner in _FUNCTION.findall(body):
        name = name.strip()
        props = schemas.get(name, {})
        arguments = {key.strip(): _xml_value(value, props.get(key.strip())) for key, value in _PARAMETER.findall(inner)}
        calls.append(_call(name, arguments))
    return calls


def _glm_calls(body: str, schemas: Schemas) -> list[dict[str, Any]]:
    """GLM-4.x's `NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>...` (values read as the XML
    form's are); a bare name counts only when it names an offered tool. [] when it is not such a call."""
    name, sep, rest = body.partition(_GLM_KEY)
    name = name.strip()
    if not _GLM_NAME.fullmatch(name) or (not sep and name not in schemas):
        return []
    props = schemas.get(name, {})
    pairs = _GLM_ARG.findall(sep + rest)
    if sep and not pairs:
        return []
    return [_call(name, {key.strip(): _xml_value(value, props.get(key.strip())) for key, value in pairs})]


def _calls_from_block(body: str, schemas: Schemas) -> list[dict[str, Any]]:
    """The calls of one `<tool_call>` block: Hermes JSON, Qwen3-Coder XML or GLM's keys and values; [] when it is
    none of them."""
    if body.startswith("<function="):
        return _xml_calls(body, schemas)
    call = _json_call(_loads(body))
    if call is not None:
        return [call]
    return _glm_calls(body, schemas) if not body.startswith(("{", "[")) else []


def _mistral_calls(text: str) -> list[dict[str, Any]] | None:
    """`[{"name": ...}, ...]` or `NAME[ARGS]{...}NAME[ARGS]{...}`; None when it is neither."""
    text = text.strip()
    if text.startswith("["):
        listed = _loads(text)
        if isinstance(listed, list) and listed:
            found = [_json_call(obj) for obj in listed]
            return [c for c in found if c is not None] if all(c is not None for c in found) else None
        return None
    calls: list[dict[str, Any]] = []
    for part in text.split(MISTRAL):
        name, sep, args = part.partition("[ARGS]")
        arguments = _loads(args)
        if not sep or not name.strip() or not isinstance(arguments, dict):
            return None
        calls.append(_call(name.strip(), arguments))
    return calls or None


def _whole_answer_calls(text: str, schemas: Schemas) -> list[dict[str, Any]] | None:
    """A whole answer that is a call without tags: Mistral's after its marker, or Llama 3's JSON object (only when
    it names an offered tool, so an answer that merely is JSON stays an answer)."""
    stripped = text.strip().removeprefix(PYTHON_TAG).strip()
    if stripped.startswith(MISTRAL):
        return _mistral_calls(stripped[len(MISTRAL):])
    if stripped.startswith("[{"):
        calls = _mistral_calls(stripped)
        if calls and all(c["function"]["name"] in schemas for c in calls):
            return calls
        return None
    if stripped.startswith("{"):
        call = _json_call(_loads(stripped))
        if call is not None and call["function"]["name"] in schemas:
            return [call]
        return None
    found = pythonic.pythonic_calls(stripped) if _PYTHONIC_START.match(stripped) else None
    if found and all(name in schemas for name, _ in found):  # LFM2's calls, their control-token markers left out
        return [_call(name, arguments) for name, arguments in found]
    return None


def _lfm2_calls(text: str) -> ParsedOutput:
    """LFM2's marked blocks of Python calls; a block that is not such calls stays in the content."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    pos = 0
    while (start := text.find(pythonic.OPEN, pos)) >= 0:
        end = text.find(pythonic.CLOSE, start)
        stop = len(text) if end < 0 else end + len(pythonic.CLOSE)
        found = pythonic.pythonic_calls(text[start + len(pythonic.OPEN):end if end >= 0 else len(text)])
        kept.append(text[pos:stop] if found is None else text[pos:start])
        calls += [_call(name, arguments) for name, arguments in found or ()]
        pos = stop
    kept.append(text[pos:])
    content = "".join(kept)
    return ParsedOutput(content.strip() or None, calls) if calls else ParsedOutput(text)


def parse_tool_calls(text: str, tools: list[dict[str, Any]] | None = None) -> ParsedOutput:
    """Every well-formed `<tool_call>` block becomes a call (or several); a block that is neither JSON with a name
    nor `<function=...>` stays in the content verbatim. A last block left open (generation stopped at
    `</tool_call>`) still counts when complete. Without tags, a whole answer in Mistral's or Llama 3's form is
    read as calls. With at least one call, the remaining content is stripped and None when empty."""
    schemas = schemas_of(tools)
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    pos = 0
    while True:
        start = text.find(OPEN, pos)
        if start < 0:
            kept.append(text[pos:])
            break
        end = text.find(CLOSE, start)
        stop = len(text) if end < 0 else end + len(CLOSE)
        found = _calls_from_block(text[start + len(OPEN):end if end >= 0 else len(text)].strip(), schemas)
        if not found:
            kept.append(text[pos:stop])
        else:
            kept.append(text[pos:start])
            calls += found
        pos = stop
        if end < 0:
            break
    content = "".join(kept)
    if not calls and pythonic.OPEN in text:
        return _lfm2_calls(text)
    if not calls and gemma4.OPEN in text:
        rest, found_calls = gemma4.gemma4_blocks(text)
        if found_calls:
            return ParsedOutput(rest.strip() or None, [_call(name, arguments) for name, arguments in found_calls])
        return ParsedOutput(text)
    if not calls and deepseek.OPEN in text:
        rest, found_calls = deepseek.deepseek_blocks(text)
        if found_calls:
            return ParsedOutput(rest.strip() or None, [_call(name, arguments) for name, arguments in found_calls])
        return ParsedOutput(text)
    if not calls:
        mistral = text.find(MISTRAL)
        whole = _whole_answer_calls(text[mistral:] if mistral > 0 else text, schemas)
        if whole:
            before = text[:mistral].strip() if mistral > 0 else ""
            return ParsedOutput(before or None, whole)
        return ParsedOutput(text)
    return ParsedOutput(content.strip() or None, calls)


MARKERS = (OPEN, MISTRAL, PYTHON_TAG, pythonic.OPEN, gemma4.OPEN, deepseek.OPEN)
_CALL_START = re.compile(r'^(?:\{\s*"|\[\s*\{)')
# LFM2's calls without their markers: `[name(` (or, still arriving, `[name`)
_PYTHONIC_START = re.compile(r"^\[\s*[A-Za-z_][\w.]*\s*\(")
_PYTHONIC_PREFIX = re.compile(r"^\[\s*[A-Za-z_][\w.]{0,63}\s*$")


def _marker_prefix_len(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a marker (one that may be arriving)."""
    best = 0
    for marker in MARKERS:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best


class ToolCallStream:
    """Streams content through until a call opens (`<tool_call>`, `[TOOL_CALLS]`, `<|python_tag|>`, `<|tool_call>`,
    `<｜tool▁calls▁begin｜>`, or an answer
    that starts as a JSON call would); from there holds everything until `finish()`.

    Text that might be the start of a marker (`<tool`) is held back until the next delta decides it.
    """

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self._tools = tools
        self._held = ""
        self._in_call = False
        self._started = False  # content other than white space has been let through

    def feed(self, delta: str) -> str:
        """The part of `delta` (plus anything held back before) that is safe to send as content now."""
        if self._in_call:
            self._held += delta
            return ""
        text = self._held + delta
        if not self._started:
            head = text.lstrip()
            if len(head) < 2 and head in ("", "{", "["):
                self._held = text  # too early to tell a JSON call from an answer
                return ""
            if _CALL_START.match(head) or (self._tools and _PYTHONIC_START.match(head)):
                self._in_call = True  # Llama 3's, Mistral's or LFM2's call without tags may be coming
                self._held = text
                return ""
            if self._tools and _PYTHONIC_PREFIX.match(head):
                self._held = text  # `[get_wea`: a call's name, or an answer's bracket
                return ""
            self._started = True
        found = [i for i in (text.find(m) for m in MARKERS) if i >= 0]
        if found:
            start = min(found)
            self._in_call = True
            self._held = text[start:]
            return text[:start]
        keep = _marker_prefix_len(text)
        self._held = text[len(text) - keep:]
        return text[:len(text) - keep]

    def finish(self) -> ParsedOutput:
        """What is left at the end of the stream: content to send and the parsed calls (maybe none)."""
        held, self._held = self._held, ""
        if not self._in_call:
            return ParsedOutput(held)
        parsed = parse_tool_calls(held, self._tools)
        if parsed.tool_calls:
            return ParsedOutput(parsed.content or "", parsed.tool_calls)
        return ParsedOutput(held)
