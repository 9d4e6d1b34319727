"""The engine's errors.

Domain errors (`EngineError` and its kinds) are what the runtime and the cache raise when they refuse a call:
they say what was wrong and, in `param`, which input; they know nothing of HTTP. `engine/server/` alone maps
each kind to an HTTP status and OpenAI's error shape (engine/server/errors.py). `ApiError` is that HTTP form,
raised by the server's own request checks.
"""

from __future__ import annotations


class EngineError(Exception):
    """A call the engine refuses; `message` says what was wrong and what is expected, `param` names the input."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class BadValue(EngineError):
    """An input the call cannot accept (empty prompt, prompt too long, unknown setting, corrupt session file)."""


class NotFound(EngineError):
    """What the call names does not exist (a slot id, a session file)."""


class Busy(EngineError):
    """What the call needs is in use right now (a slot serving a request); retrying later can succeed."""


class Refused(EngineError):
    """A valid request the engine cannot carry out in its current state (the cache could not switch settings)."""


class Unavailable(EngineError):
    """The engine is not taking work (it is shutting down)."""


class ApiError(Exception):
    """A request the engine refuses; rendered as {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or _default_type(status)


def _default_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 503:
        return "unavailable_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


class ModelLoadError(Exception):
    """The model cannot be loaded; the message names the file and the reason (printed as one line, exit 2)."""
