"""Errors that reach an HTTP client: each carries its status code and OpenAI's error type."""

from __future__ import annotations


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
