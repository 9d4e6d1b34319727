"""What a request says about its conversation: priority, pin and client, from the OpenAI `metadata` object or
`X-Strata-*` headers (a header wins over metadata), plus a name taken from the first user message.

    metadata: {"strata_priority": "high" | "normal" | "low", "strata_pin": "true" | "false", "strata_client": "..."}
    headers:  X-Strata-Priority, X-Strata-Pin, X-Strata-Client (same values)

Any other `strata_` metadata key, or a value outside these, is a 400 that names it and what is expected; other
metadata keys are the client's own and ignored. Without a client name the User-Agent's first product token
("OpenAI/Python 1.55.0" -> "OpenAI/Python") stands in.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.cache.attrs import MAX_CLIENT_CHARS, MAX_NAME_CHARS, PRIORITIES, ConvAttrs
from engine.errors import ApiError
from engine.server.prompts import content_text
from engine.server.schemas import ChatCompletionRequest, CompletionRequest

FIELDS = {"priority": "strata_priority", "pin": "strata_pin", "client": "strata_client"}
HEADERS = {"priority": "x-strata-priority", "pin": "x-strata-pin", "client": "x-strata-client"}
PIN_VALUES = {"true": True, "false": False}


def _given(name: str, metadata: Mapping[str, Any], headers: Mapping[str, str]) -> tuple[str, str] | None:
    """(value, where it came from) of one attribute, the header first; None when neither gives it."""
    header = HEADERS[name]
    if header in headers:
        return headers[header], "X-Strata-" + name.capitalize()
    key = FIELDS[name]
    if key in metadata:
        value = metadata[key]
        if not isinstance(value, str):
            raise ApiError(400, f"'metadata.{key}': expected a string, got {value!r}"[:200], param=f"metadata.{key}")
        return value, f"metadata.{key}"
    return None


def _param(where: str) -> str:
    return where if where.startswith("metadata.") else where.lower()


def request_attrs(metadata: Mapping[str, Any] | None, headers: Mapping[str, str], first_user_text: str,
                  system_text: str = "", api: str = "") -> ConvAttrs:
    """The conversation attributes of one request (`headers` with lower-case names, as Starlette gives them).

    A client that names itself is shown as named; otherwise the User-Agent's first product and the API it spoke
    (`api`: "Chat Completions", "Completions", "Messages", "Responses"), so a Monitor row says "claude-cli/2.1 ·
    Messages" and an agent's conversations are told from a chat's."""
    metadata = metadata or {}
    unknown = sorted(k for k in metadata if k.startswith("strata_") and k not in FIELDS.values())
    if unknown:
        raise ApiError(400, f"'metadata.{unknown[0]}': unknown key; the strata_ keys are "
                       f"{', '.join(FIELDS.values())}", param=f"metadata.{unknown[0]}")
    priority = pinned = None
    if (given := _given("priority", metadata, headers)) is not None:
        value, where = given
        priority = value.strip().lower()
        if priority not in PRIORITIES:
            raise ApiError(400, f"'{where}': expected one of high, normal, low, got {value!r}"[:200],
                           param=_param(where))
    if (given := _given("pin", metadata, headers)) is not None:
        value, where = given
        if value.strip().lower() not in PIN_VALUES:
            raise ApiError(400, f"'{where}': expected true or false, got {value!r}"[:200], param=_param(where))
        pinned = PIN_VALUES[value.strip().lower()]
    given = _given("client", metadata, headers)
    if given is not None:
        client = _printable(given[0])[:MAX_CLIENT_CHARS]
    else:
        suffix = f" · {api}" if api else ""
        product = _printable(headers.get("user-agent", "").split(" ", 1)[0])[:MAX_CLIENT_CHARS - len(suffix)]
        client = f"{product}{suffix}" if product else api
    return ConvAttrs(priority, pinned, conversation_name(first_user_text), client, conversation_name(system_text))


def chat_attrs(req: ChatCompletionRequest, headers: Mapping[str, str]) -> ConvAttrs:
    """A chat request's attributes; its name comes from its first user message, its system words from its first
    system (or developer) message."""
    first = next((i for i, m in enumerate(req.messages) if m.role == "user"), None)
    # its name only: the prompt's rendering refuses or omits media (content_parts.py), not this
    text = "" if first is None else content_text(req.messages[first].content, f"messages[{first}].content",
                                                 omit_media=True)
    sys_i = next((i for i, m in enumerate(req.messages) if m.role in ("system", "developer")), None)
    system = "" if sys_i is None else content_text(req.messages[sys_i].content, f"messages[{sys_i}].content",
                                                   omit_media=True)
    return request_attrs(req.metadata, headers, (text or "")[:4096], (system or "")[:4096], "Chat Completions")


def completion_attrs(req: CompletionRequest, headers: Mapping[str, str]) -> ConvAttrs:
    """A completion request's attributes; its name comes from its prompt text (none for token ids)."""
    prompt = req.prompt
    if isinstance(prompt, list):
        prompt = next((p for p in prompt if isinstance(p, str)), "")
    return request_attrs(req.metadata, headers, prompt[:4096] if isinstance(prompt, str) else "", api="Completions")


def _printable(text: str) -> str:
    return "".join(ch for ch in text if ch.isprintable()).strip()


def conversation_name(text: str) -> str:
    """The first words of `text`, at most MAX_NAME_CHARS characters (a longer first word is cut)."""
    words = _printable(" ".join(text.split())).split(" ")
    name = ""
    for word in words:
        candidate = f"{name} {word}" if name else word
        if len(candidate) > MAX_NAME_CHARS:
            return name or word[:MAX_NAME_CHARS]
        name = candidate
    return name


def template_attrs(messages: list[dict[str, Any]], metadata: Mapping[str, Any] | None,
                   headers: Mapping[str, str], api: str) -> ConvAttrs:
    """The attributes of a request already turned into chat-template messages (Anthropic Messages, OpenAI
    Responses): named from its first user message, its system words from its first system message."""
    user = next((m["content"] for m in messages if m["role"] == "user"), "")
    system = next((m["content"] for m in messages if m["role"] == "system"), "")
    return request_attrs(metadata, headers, user[:4096], system[:4096], api)
