"""OpenAI's error shape, and turning a pydantic validation failure into one clear sentence."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from engine.errors import ApiError, BadValue, Busy, EngineError, NotFound, Refused, Unavailable

# The one place a domain error of the runtime or the cache becomes an HTTP status.
DOMAIN_STATUS: dict[type[EngineError], int] = {BadValue: 400, NotFound: 404, Busy: 409, Refused: 409, Unavailable: 503}


def error_body(message: str, type: str, param: str | None = None, code: str | int | None = None) -> dict[str, Any]:
    """{"error": {"message", "type", "param", "code"}} as OpenAI's API returns it."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# Anthropic's error types by status (its API reference, "Errors"); 503 is its overloaded_error.
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
ANTHROPIC_PATHS = ("/v1/messages", "/messages")


def speaks_anthropic(path: str) -> bool:
    """Whether a route's clients expect Anthropic's error shape (the Messages API) rather than OpenAI's."""
    return path.startswith(ANTHROPIC_PATHS)


def anthropic_error_body(err: ApiError) -> dict[str, Any]:
    """{"type": "error", "error": {"type", "message"}} as Anthropic's API returns it."""
    kind = ANTHROPIC_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def error_response(err: ApiError, headers: dict[str, str] | None = None, path: str = "") -> JSONResponse:
    """The HTTP response for a refused request, in the shape the route's API uses: OpenAI's (`code` repeats the
    status as OpenAI-compatible servers do) or, under /v1/messages, Anthropic's."""
    body = anthropic_error_body(err) if speaks_anthropic(path) else error_body(err.message, err.type, err.param,
                                                                                 err.status)
    return JSONResponse(body, status_code=err.status, headers=headers)


def from_domain(exc: EngineError) -> ApiError:
    """The HTTP form of a domain error: its status by kind, OpenAI's error type, the same message and param."""
    status = next((code for kind, code in DOMAIN_STATUS.items() if isinstance(exc, kind)), 500)
    return ApiError(status, exc.message, param=exc.param)


def loc_to_param(loc: tuple[Any, ...]) -> str | None:
    """('messages', 0, 'role') -> 'messages[0].role'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def validation_error(exc: ValidationError) -> ApiError:
    """A 400 naming the first offending field, what it should be, and what it got."""
    err = exc.errors(include_url=False)[0]
    kind = err["type"]
    if kind == "json_invalid":
        detail = err.get("ctx", {}).get("error", err["msg"])
        if "hex escape" in detail:  # the parser's words for a \ud800-\udfff escape without its other half
            where = detail[detail.find(" at line "):] if " at line " in detail else ""
            detail = (f"a \\u escape{where} is half of a UTF-16 surrogate pair without its other half (as text cut "
                      "between the two halves of an emoji gives); send whole pairs, or U+FFFD in its place")
        return ApiError(400, f"the request body is not valid JSON: {detail}")
    loc = tuple(err["loc"])
    param = loc_to_param(loc)
    if kind == "model_type" and not loc:
        return ApiError(400, f"the request body must be a JSON object, got {_type_name(err['input'])}")
    if kind == "missing":
        return ApiError(400, f"'{param}' is required", param=param)
    message = err["msg"][0].lower() + err["msg"][1:]
    return ApiError(400, f"'{param}': {message}, got {_shown(err['input'])}", param=param)


def _type_name(value: Any) -> str:
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if value is None:
        return "null"
    return type(value).__name__
