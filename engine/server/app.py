"""The FastAPI application: routes, the API-key guard, and OpenAI-shaped errors for every failure."""

from __future__ import annotations

import hmac
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from engine import __version__
from engine.errors import ApiError, EngineError
from engine.server import control_routes, openai_routes
from engine.server.errors import error_response, from_domain, loc_to_param, validation_error
from engine.server.state import ServerState, require_engine, server_state

__all__ = ["ServerState", "create_app", "require_engine", "server_state"]

log = logging.getLogger("strata.server")


class ApiKeyGuard:
    """Refuses every HTTP request without `Authorization: Bearer KEY` (401 in OpenAI's error shape)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = b"bearer " + api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"authorization")
            if given is None:
                message = "missing API key: send 'Authorization: Bearer KEY' (this server was started with --api-key)"
            elif not hmac.compare_digest(_bearer_lower(given), self.expected):
                message = "invalid API key"
            else:
                message = ""
            if message:
                err = ApiError(401, message)
                await error_response(err, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _bearer_lower(header: bytes) -> bytes:
    # The scheme is case-insensitive, the key is not.
    scheme, _, key = header.strip().partition(b" ")
    return scheme.lower() + b" " + key.strip()


def create_app(state: ServerState) -> FastAPI:
    """The HTTP API over `state.engine` (which may still be None while the model loads)."""
    app = FastAPI(title="Strata", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    app.include_router(openai_routes.router)
    app.include_router(control_routes.router)

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, exc: ApiError) -> JSONResponse:
        if exc.status >= 500 and exc.status != 503:
            log.error("%s %s: %s", request.method, request.url.path, exc.message)
        return error_response(exc)

    @app.exception_handler(EngineError)
    async def on_engine_error(request: Request, exc: EngineError) -> JSONResponse:
        return await on_api_error(request, from_domain(exc))

    @app.exception_handler(ValidationError)
    async def on_validation_error(request: Request, exc: ValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(RequestValidationError)
    async def on_request_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        param = loc_to_param(tuple(p for p in first["loc"] if p not in ("body", "query", "path")))
        return error_response(ApiError(400, f"'{param}': {first['msg']}", param=param))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}; see docs/API.md for the endpoints"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return error_response(ApiError(exc.status_code, message), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises after this response is sent, and uvicorn logs the traceback once.
        log.error("%s %s failed: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
        return error_response(ApiError(500, f"internal error: {type(exc).__name__}: {exc}"))

    if state.config.api_key:
        app.add_middleware(ApiKeyGuard, api_key=state.config.api_key)
    return app
