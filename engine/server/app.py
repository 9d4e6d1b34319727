"""The FastAPI application: routes, the API-key guard, and OpenAI-shaped errors for every failure."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine import __version__
from engine.errors import ApiError, EngineError
from engine.server import anthropic_routes, control_routes, openai_routes, responses_routes
from engine.server.errors import error_response, from_domain, loc_to_param, validation_error
from engine.server.guards import (
    MIB,
    WILDCARD_BINDS,
    ApiKeyGuard,
    BodyGuard,
    HostGuard,
    OriginGuard,
    split_list,
)
from engine.server.openapi import build_openapi
from engine.server.state import ServerState, require_engine, server_state

__all__ = ["ServerState", "create_app", "require_engine", "server_state"]

log = logging.getLogger("strata.server")


def create_app(state: ServerState) -> FastAPI:
    """The HTTP API over `state.engine` (which may still be None while the model loads)."""
    # /openapi.json describes the API for clients and fuzzers; no /docs page (it would load scripts from a CDN).
    app = FastAPI(title="Strata", version=__version__, docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.server = state
    app.include_router(openai_routes.router)
    app.include_router(anthropic_routes.router)
    app.include_router(responses_routes.router)
    app.include_router(control_routes.router)
    app.openapi = lambda: build_openapi(app)  # type: ignore[method-assign]

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, exc: ApiError) -> JSONResponse:
        if exc.status >= 500 and exc.status != 503:
            log.error("%s %s: %s", request.method, request.url.path, exc.message)
        return error_response(exc, path=request.url.path)

    @app.exception_handler(EngineError)
    async def on_engine_error(request: Request, exc: EngineError) -> JSONResponse:
        return await on_api_error(request, from_domain(exc))

    @app.exception_handler(ValidationError)
    async def on_validation_error(request: Request, exc: ValidationError) -> JSONResponse:
        return error_response(validation_error(exc), path=request.url.path)

    @app.exception_handler(RequestValidationError)
    async def on_request_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        param = loc_to_param(tuple(p for p in first["loc"] if p not in ("body", "query", "path")))
        return error_response(ApiError(400, f"'{param}': {first['msg']}", param=param), path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}; see docs/API.md for the endpoints"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return error_response(ApiError(exc.status_code, message), headers=getattr(exc, "headers", None),
                              path=request.url.path)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises after this response is sent, and uvicorn logs the traceback once.
        log.error("%s %s failed: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
        return error_response(ApiError(500, f"internal error: {type(exc).__name__}: {exc}"), path=request.url.path)

    # Added innermost first: a request meets HostGuard, OriginGuard, ApiKeyGuard, BodyGuard (engine/server/guards.py).
    config = state.config
    app.add_middleware(BodyGuard, max_bytes=config.max_request_mib * MIB)
    if config.api_key:
        app.add_middleware(ApiKeyGuard, api_key=config.api_key)
    app.add_middleware(OriginGuard, cors_origins=split_list(config.cors_origins))
    app.add_middleware(HostGuard, bound_host=config.host, allowed_hosts=split_list(config.allowed_hosts))
    if config.host.strip() in WILDCARD_BINDS and not split_list(config.allowed_hosts):
        log.warning("bound to %s: only requests addressed to 127.0.0.1, localhost or ::1 are answered; list the names "
                    "and addresses clients use with --allowed-hosts (or * for any)", config.host)
    return app
