"""Server-sent events framing, and reading an engine stream while watching for the client to go away."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator
from typing import Any

from starlette.requests import Request

from engine.runtime.requests import TokenEvent

SSE_DONE = "data: [DONE]\n\n"
SSE_KEEPALIVE = ": keep-alive\n\n"  # an SSE comment: clients skip it, proxies and idle timers see traffic
KEEPALIVE_S = 10.0
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(obj: dict[str, Any]) -> str:
    """One `data:` event; JSON never contains a raw newline, so one line is always one event."""
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


class ClientDisconnected(Exception):
    """The HTTP client went away before its request finished; its stream was cancelled."""


async def wait_disconnect(request: Request) -> None:
    # The body has been read already, so the next ASGI message can only be the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def engine_events(stream: Any, request: Request) -> AsyncGenerator[TokenEvent, None]:
    """The stream's events up to and including the final one.

    Raises ClientDisconnected when the client goes away first. Whenever iteration stops before the final event
    (disconnect, the response task being cancelled, the consumer closing us) the stream is cancelled, so the
    engine frees the slot.
    """
    watcher = asyncio.ensure_future(wait_disconnect(request))
    step: asyncio.Future[TokenEvent] | None = None
    finished = False
    try:
        while True:
            step = asyncio.ensure_future(stream.__anext__())
            done, _ = await asyncio.wait({step, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if step not in done:
                raise ClientDisconnected
            try:
                event = step.result()
            except StopAsyncIteration:
                return
            if event.finish_reason is not None:
                finished = True
            yield event
            if finished:
                return
    finally:
        watcher.cancel()
        if step is not None and not step.done():
            step.cancel()
        if not finished:
            stream.cancel()


async def with_heartbeat(events: AsyncGenerator[TokenEvent, None], interval_s: float
                         ) -> AsyncGenerator[TokenEvent | None, None]:
    """`events`, with None whenever `interval_s` pass without one: a long prefill sends nothing for minutes, and
    clients (Claude Code, proxies) drop a stream that stays silent."""
    step: asyncio.Future[TokenEvent] | None = None
    try:
        while True:
            if step is None:
                step = asyncio.ensure_future(events.__anext__())
            done, _ = await asyncio.wait({step}, timeout=interval_s)
            if not done:
                yield None
                continue
            try:
                event = step.result()
            except StopAsyncIteration:
                return
            step = None
            yield event
    finally:
        if step is not None and not step.done():
            step.cancel()
            # Wait for it to stop: `events` cannot be closed (aclosing) while its step is still running.
            with contextlib.suppress(BaseException):
                await step
