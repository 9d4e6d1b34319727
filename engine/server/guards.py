"""What stands between the network and the routes: the Host check (DNS rebinding), the Origin check and CORS
preflights (cross-site requests from web pages), the API key, and the request body's type and size.

A web page the user visits can send "simple" requests to 127.0.0.1 without asking (a form post, a `text/plain`
fetch) and, through DNS rebinding, can make its own origin resolve to 127.0.0.1. So, outermost first:

1. `HostGuard`: the Host header must name the bound address, a loopback name or one of --allowed-hosts (403).
2. `OriginGuard`: a preflight (OPTIONS with Access-Control-Request-Method) is answered only for an origin in
   --cors-origins (403 otherwise); any other request that changes state (not GET/HEAD) and carries an Origin that
   is neither this server nor in --cors-origins is refused (403). Allowed origins get CORS headers from
   Starlette's CORSMiddleware.
3. `ApiKeyGuard`: `Authorization: Bearer KEY` when --api-key is set; GET and HEAD /health stay open.
4. `BodyGuard`: a body must be `application/json` (415) and at most --max-request-mib (413); the body is read
   here, so the routes never see more than the limit, and handed on as UTF-8 (a UTF-16 or UTF-32 body, by its
   charset or byte order mark, is re-encoded; any other charset is a 415: engine/server/body_charset.py).

Every refusal is in OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Iterable
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.errors import ApiError
from engine.server.body_charset import declared_charset, to_utf8
from engine.server.errors import error_response

LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})
BODY_IDLE_S = 15.0  # the longest a request body may pause between bytes (its head: engine/server/http_protocol.py)
WILDCARD_BINDS = frozenset({"0.0.0.0", "::", ""})
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
OPEN_PATHS = frozenset({"/health"})  # answerable without the API key: it says only ok / loading
MIB = 1 << 20


def split_list(text: str) -> list[str]:
    """'a, b,,c' -> ['a', 'b', 'c'] (the comma-separated settings)."""
    return [part.strip() for part in text.split(",") if part.strip()]


def host_name(host_header: str) -> str:
    """The name part of a Host header, lower-cased: 'LocalHost:8080' -> 'localhost', '[::1]:80' -> '::1'."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


async def _refuse(scope: Scope, receive: Receive, send: Send, err: ApiError,
                  headers: dict[str, str] | None = None) -> None:
    await error_response(err, headers=headers, path=scope.get("path", ""))(scope, receive, send)


class HostGuard:
    """Refuses a Host header that names neither the bound address, a loopback name, nor an allowed host."""

    def __init__(self, app: ASGIApp, bound_host: str, allowed_hosts: Iterable[str]) -> None:
        self.app = app
        allowed = {host_name(h) for h in allowed_hosts}
        self.any_host = "*" in allowed
        bound = host_name(bound_host)
        self.allowed = LOOPBACK_NAMES | allowed | ({bound} if bound not in WILDCARD_BINDS else set())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self.any_host:
            given = Headers(scope=scope).get("host")
            # HTTP/1.0 may omit Host; browsers always send it, so its absence is no rebinding attack.
            if given is not None and host_name(given) not in self.allowed:
                shown = given if len(given) <= 100 else given[:97] + "..."
                message = (f"Host {shown!r} is not allowed: this server answers to {', '.join(sorted(self.allowed))}; "
                           "start it with --allowed-hosts NAME to reach it under another name "
                           "(this check stops DNS-rebinding attacks from web pages)")
                await _refuse(scope, receive, send, ApiError(403, message, param="Host", type="permission_error"))
                return
        await self.app(scope, receive, send)


class OriginGuard:
    """CORS preflights for --cors-origins only; state-changing requests from any other web origin are refused."""

    def __init__(self, app: ASGIApp, cors_origins: Iterable[str]) -> None:
        origins = [o.rstrip("/") for o in cors_origins]
        self.any_origin = "*" in origins
        self.origins = frozenset(o.lower() for o in origins if o != "*")
        # Starlette answers allowed preflights and adds the CORS headers to allowed requests.
        self.app = app if not (self.origins or self.any_origin) else CORSMiddleware(
            app, allow_origins=["*"] if self.any_origin else sorted(self.origins), allow_methods=["*"],
            allow_headers=["Authorization", "Content-Type", "X-Strata-Priority", "X-Strata-Pin", "X-Strata-Client"], expose_headers=["Retry-After"], max_age=600)

    def allows(self, origin: str, host: str | None) -> bool:
        if self.any_origin or origin.lower().rstrip("/") in self.origins:
            return True
        # The server's own origin (a page it served, or a tool on this machine that sets Origin).
        parts = urlsplit(origin)
        return host is not None and parts.scheme in ("http", "https") and parts.netloc.lower() == host.lower()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = Headers(scope=scope)
            origin = headers.get("origin")
            method = scope["method"]
            if origin is not None and not self.allows(origin, headers.get("host")):
                shown = origin if len(origin) <= 100 else origin[:97] + "..."
                if method == "OPTIONS" and "access-control-request-method" in headers:
                    message = (f"cross-origin requests from {shown!r} are not allowed; start the server with "
                               "--cors-origins ORIGIN to let that page call it")
                    await _refuse(scope, receive, send, ApiError(403, message, type="permission_error"))
                    return
                if method not in SAFE_METHODS:
                    message = (f"{method} {scope['path']} refused: the request comes from the web page {shown!r}, "
                               "which is not in --cors-origins")
                    await _refuse(scope, receive, send, ApiError(403, message, type="permission_error"))
                    return
        await self.app(scope, receive, send)


class ApiKeyGuard:
    """Refuses every HTTP request without `Authorization: Bearer KEY` or `x-api-key: KEY` (Anthropic's SDKs send the
    latter) (401), except GET and HEAD /health."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = b"bearer " + api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not (scope["path"] in OPEN_PATHS and scope["method"] in ("GET", "HEAD")):
            headers = dict(scope["headers"])
            given = headers.get(b"authorization")
            if given is None and b"x-api-key" in headers:
                given = b"bearer " + headers[b"x-api-key"].strip()
            if given is None:
                message = ("missing API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY' (this server was "
                           "started with --api-key)")
            elif not hmac.compare_digest(_bearer_lower(given), self.expected):
                message = "invalid API key"
            else:
                message = ""
            if message:
                await _refuse(scope, receive, send, ApiError(401, message), headers={"WWW-Authenticate": "Bearer"})
                return
        await self.app(scope, receive, send)


def _bearer_lower(header: bytes) -> bytes:
    # The scheme is case-insensitive, the key is not.
    scheme, _, key = header.strip().partition(b" ")
    return scheme.lower() + b" " + key.strip()


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


class BodyGuard:
    """Bodies must be JSON and at most `max_bytes`; reads the whole body before the route runs and hands it on
    as UTF-8."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        assert max_bytes > 0
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self, size: str) -> ApiError:
        limit = f"{self.max_bytes / MIB:g} MiB"
        return ApiError(413, f"the request body is {size}, over the limit of {limit} ({self.max_bytes} bytes); "
                        "send a smaller request or start the server with a larger --max-request-mib")

    @staticmethod
    def _not_json(scope: Scope, given: str) -> ApiError:
        # A browser sends text/plain and form bodies cross-site without asking first: never take them as JSON.
        return ApiError(415, f"{scope['method']} {scope['path']}: expected a JSON body sent with "
                        f"'Content-Type: application/json', got {given}", param="Content-Type")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        content_type = headers.get("content-type")
        length = headers.get("content-length")
        if length is not None and length.strip().isascii() and length.strip().isdigit() \
                and int(length) > self.max_bytes:
            await _refuse(scope, receive, send, self._too_large(f"{int(length)} bytes"))
            return
        if content_type is not None and not _is_json(content_type):
            await _refuse(scope, receive, send, self._not_json(scope, f"Content-Type {content_type[:80]!r}"))
            return
        try:
            charset = declared_charset(content_type)
        except ApiError as exc:
            await _refuse(scope, receive, send, exc)
            return
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            try:
                message = await asyncio.wait_for(receive(), BODY_IDLE_S)
            except TimeoutError:  # a stalled body would hold its buffered bytes for as long as the client likes
                await _refuse(scope, receive, send, ApiError(
                    408, f"the request body stalled: no bytes for {BODY_IDLE_S:g} s after {size} of them"))
                return
            if message["type"] != "http.request":  # the client left while sending
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await _refuse(scope, receive, send, self._too_large(f"more than {self.max_bytes} bytes"))
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        if content_type is None and size > 0:
            await _refuse(scope, receive, send, self._not_json(scope, "no Content-Type"))
            return
        try:
            body = to_utf8(b"".join(chunks), charset)
        except ApiError as exc:
            await _refuse(scope, receive, send, exc)
            return
        if charset is not None or size != len(body):
            scope = _as_utf8(scope, len(body))
        replayed = False

        async def replay() -> Message:
            # The body once, then the real channel: the routes watch it for the client's disconnect.
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def _as_utf8(scope: Scope, length: int) -> Scope:
    """The request's scope with headers that say what the routes now read: UTF-8 of `length` bytes."""
    headers = [(k, v) for k, v in scope["headers"] if k not in (b"content-type", b"content-length")]
    media = Headers(scope=scope).get("content-type", "application/json").split(";", 1)[0].strip()
    headers += [(b"content-type", f"{media}; charset=utf-8".encode("latin-1")),
                (b"content-length", str(length).encode())]
    return {**scope, "headers": headers}
