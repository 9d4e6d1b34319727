"""Routes for operators and the desktop app: /health, /metrics, /slots, /cache/*, /shutdown.

The read-only routes (/metrics, /slots, /cache/conversations, /cache/events, /cache/requests, GET /cache/config)
never wait on the engine thread: they serve the snapshot it publishes (`Engine.stats_snapshot`) or read fields it
replaces whole, so they answer at once while a step decodes or prefills. Routes that change state run on the engine thread."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ConfigDict
from starlette.background import BackgroundTask

from engine.cache.attrs import PRIORITIES
from engine.config import PURGE_TIERS
from engine.contract import (
    CacheConfigBody,
    ConversationRow,
    ConversationsBody,
    Event,
    EventsBody,
    MetricsBody,
    PurgeBody,
    RequestsBody,
    parse,
    to_json,
)
from engine.errors import ApiError
from engine.runtime.explain import REQUEST_LOG_SIZE
from engine.server.prometheus import CONTENT_TYPE as PROMETHEUS_TYPE
from engine.server.prometheus import render_prometheus
from engine.server.schemas import StrictBody, parse_body
from engine.server.slot_names import check_slot_file_name
from engine.server.state import require_engine, server_state

router = APIRouter()

SLOT_ACTIONS = ("save", "restore", "erase")
MAX_EVENTS = 10000


class SlotFileRequest(StrictBody):
    filename: str


class PurgeRequest(StrictBody):
    tier: str = "all"


class ConversationPatch(StrictBody):
    """PATCH /cache/conversations/{id}: what to change; any other field is refused (`unknown_field`)."""

    # Kept, then refused by name: "forbid" would make pydantic keep an error for each of a million extra keys.
    model_config = ConfigDict(extra="allow", strict=True)
    priority: str | None = None
    pinned: bool | None = None

    def unknown_field(self) -> str | None:
        return next(iter(self.model_extra or {}), None)


@router.get("/health")
@router.head("/health")
async def health(request: Request) -> JSONResponse:
    """503 "loading" with the start-up phase while the model loads, 200 "ok" once the engine serves.

    HEAD too: load balancers and `curl -I` probe with it; the server sends GET's status and headers, no body."""
    state = server_state(request)
    ready = state.engine is not None
    return JSONResponse(to_json(state.progress.health(ready)), status_code=200 if ready else 503)


def _wants_prometheus(request: Request) -> bool:
    fmt = request.query_params.get("format")
    if fmt is not None:
        if fmt not in ("json", "prometheus"):
            raise ApiError(400, f"'format': expected json or prometheus, got {fmt!r}", param="format")
        return fmt == "prometheus"
    accept = request.headers.get("accept", "")
    return "application/json" not in accept and ("text/plain" in accept or "openmetrics" in accept)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Engine and conversation-cache stats, as JSON (default) or Prometheus text."""
    prometheus = _wants_prometheus(request)
    snapshot = require_engine(request).stats_snapshot()
    body = MetricsBody(engine=snapshot["engine"], conversation_cache=snapshot["conversation_cache"])
    if prometheus:
        return Response(render_prometheus(body), media_type=PROMETHEUS_TYPE)
    return JSONResponse(to_json(body))


@router.get("/slots")
async def list_slots(request: Request) -> list[dict[str, Any]]:
    return require_engine(request).stats_snapshot()["slots"]


@router.post("/slots/{slot_id}")
async def slot_action(slot_id: str, request: Request) -> dict[str, Any]:
    """?action=save|restore with {"filename": ...}, or ?action=erase."""
    engine = require_engine(request)
    action = request.query_params.get("action")
    if action not in SLOT_ACTIONS:
        raise ApiError(400, f"'action': expected one of {', '.join(SLOT_ACTIONS)}, got {action!r}", param="action")
    slot = whole_number(slot_id, "slot id", param="slot_id")
    if action == "erase":
        return await engine.run(lambda: engine.erase_slot(slot))
    filename = parse_body(SlotFileRequest, await request.body()).filename
    check_slot_file_name(filename)
    operation = engine.save_slot if action == "save" else engine.restore_slot
    try:
        return await engine.run(lambda: operation(slot, filename))
    except OSError as exc:
        # The OS's message names the full path; the client gets the file name and the reason only.
        reason = exc.strerror or type(exc).__name__
        raise ApiError(500, f"could not {action} the slot file {filename!r}: {reason}", param="filename") from None


def whole_number(raw: str, what: str, param: str, limit: int = 10**9) -> int:
    """A path or query value of ASCII digits only ('²', '１' and '٠' are digits to str.isdigit, not to us)."""
    if not (raw.isascii() and raw.isdigit()) or len(raw) > len(str(limit)):
        raise ApiError(400, f"{what}: expected a whole number written with the digits 0-9, got {raw[:40]!r}",
                       param=param)
    return int(raw)


@router.get("/cache/conversations")
async def cache_conversations(request: Request) -> dict[str, Any]:
    rows = require_engine(request).stats_snapshot()["conversations"]
    return to_json(ConversationsBody([parse(ConversationRow, row) for row in rows]))


@router.patch("/cache/conversations/{conv_id}")
async def patch_conversation(conv_id: str, request: Request) -> dict[str, Any]:
    """Change a parked conversation's priority and/or pin: {"priority": "high"|"normal"|"low", "pinned": bool}."""
    engine = require_engine(request)
    patch = parse_body(ConversationPatch, await request.body())
    if (unknown := patch.unknown_field()) is not None:
        raise ApiError(400, f"'{unknown[:100]}': unknown field; expected \"priority\" and/or \"pinned\"",
                       param=unknown[:100])
    if patch.priority is None and patch.pinned is None:
        raise ApiError(400, "expected a JSON object with \"priority\" (high, normal or low) and/or \"pinned\" "
                       "(true or false)")
    if patch.priority is not None and patch.priority not in PRIORITIES:
        raise ApiError(400, f"'priority': expected one of high, normal, low, got {patch.priority!r}"[:200],
                       param="priority")
    rows = await engine.run(lambda: engine.set_conversation(conv_id, priority=patch.priority, pinned=patch.pinned))
    return to_json(ConversationsBody([parse(ConversationRow, row) for row in rows]))


@router.delete("/cache/conversations/{conv_id}")
async def delete_conversation(conv_id: str, request: Request) -> dict[str, Any]:
    """Drop one parked conversation from every tier; answers what was dropped and skipped, as /cache/purge."""
    engine = require_engine(request)
    result = await engine.run(lambda: engine.drop_conversation(conv_id))
    return to_json(parse(PurgeBody, result))


@router.get("/cache/events")
async def cache_events(request: Request) -> dict[str, Any]:
    engine = require_engine(request)
    limit = _limit(request, default=100, most=MAX_EVENTS)
    events = engine.stats_snapshot()["events"][-limit:]
    return to_json(EventsBody([parse(Event, event) for event in events]))


@router.get("/cache/requests")
async def cache_requests(request: Request) -> dict[str, Any]:
    """The last requests explained (reused tokens, from where, why the rest was computed), oldest first."""
    engine = require_engine(request)
    limit = _limit(request, default=REQUEST_LOG_SIZE, most=REQUEST_LOG_SIZE)
    records = engine.stats_snapshot()["requests"][-limit:]
    return to_json(RequestsBody(list(records)))


def _limit(request: Request, *, default: int, most: int) -> int:
    """The `limit` query value: a whole number in [1, most]."""
    raw = request.query_params.get("limit", str(default))
    expected = f"'limit': expected a whole number in [1, {most}]"
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 9:
        raise ApiError(400, f"{expected}, got {raw[:40]!r}", param="limit")
    if not 1 <= int(raw) <= most:
        raise ApiError(400, f"{expected}, got {int(raw)}", param="limit")
    return int(raw)


@router.post("/cache/purge")
async def cache_purge(request: Request) -> dict[str, Any]:
    """Drop parked conversations of one tier (default all); reports what was dropped and what was skipped."""
    engine = require_engine(request)
    body = await request.body()
    tier = parse_body(PurgeRequest, body).tier if body.strip() else "all"
    if tier not in PURGE_TIERS:
        raise ApiError(400, f"'tier': expected one of {', '.join(PURGE_TIERS)}, got {tier!r}", param="tier")
    return to_json(parse(PurgeBody, await engine.run(lambda: engine.purge_cache(tier))))


@router.get("/cache/config")
async def get_cache_config(request: Request) -> dict[str, Any]:
    # Reads the engine's config and cache fields, which the engine thread replaces whole: safe from any thread.
    return to_json(parse(CacheConfigBody, require_engine(request).cache_config()))


@router.put("/cache/config")
async def put_cache_config(request: Request) -> dict[str, Any]:
    """Change live cache settings: {"name": value, ...} or {"settings": {...}} as GET returns them."""
    engine = require_engine(request)
    try:
        changes = json.loads(await request.body())
    except ValueError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, "the request body nests too deeply; expected a flat JSON object of settings") from None
    if isinstance(changes, dict) and set(changes) == {"settings"} and isinstance(changes["settings"], dict):
        changes = changes["settings"]
    if not isinstance(changes, dict) or not changes:
        raise ApiError(400, "expected a JSON object of settings to change, e.g. {\"conversation_cache_mib\": 2048}")
    return to_json(parse(CacheConfigBody, await engine.run(lambda: engine.update_cache_config(changes))))


@router.post("/shutdown")
async def shutdown(request: Request) -> JSONResponse:
    """Stop the server cleanly (the tiered cache spills first); answers before stopping."""
    stop = server_state(request).shutdown
    if stop is None:
        raise ApiError(501, "shutdown is not available: this server was not started by `strata serve`")
    return JSONResponse({"status": "shutting down"}, status_code=202, background=BackgroundTask(stop))
