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


def error_response(err: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    """The HTTP response for a refused request; `code` repeats the status as OpenAI-compatible servers do."""
    return JSONResponse(error_body(err.message, err.type, err.param, err.status), status_code=err.status,
                        headers=headers)


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
