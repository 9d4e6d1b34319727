"""What every generating route shares, whichever API it speaks (OpenAI chat and completions, Anthropic Messages,
OpenAI Responses): waiting for a slot, collecting a whole answer, the failure of a request the engine ended."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from engine.errors import ApiError
from engine.runtime.requests import TokenEvent
from engine.server.errors import error_response
from engine.server.harmony import message_bodies, reasoning_tokens
from engine.server.model_output import is_harmony
from engine.server.state import server_state
from engine.server.streaming import SSE_HEADERS, engine_events, wait_disconnect
from engine.server.thoughts import answer_parts, thought_tokens

log = logging.getLogger("strata.server")
RETRY_AFTER_S = 5  # what a request refused by --queue-timeout is told to wait before trying again


def failure(event: TokenEvent | None) -> ApiError:
    """The error of a request that ended without a result (None) or with finish_reason "error"."""
    reason = event.error if event is not None and event.error else "the engine ended the request without a result"
    return ApiError(500, f"generation failed: {reason}")


async def collect(stream: Any, request: Request) -> tuple[str, TokenEvent]:
    """All text of a non-streaming request and its final event; cancels the stream if the client leaves
    (raising ClientDisconnected)."""
    parts: list[str] = []
    final: TokenEvent | None = None
    async with contextlib.aclosing(engine_events(stream, request)) as events:
        async for event in events:
            parts.append(event.text)
            if event.finish_reason is not None:
                final = event
    if final is None or final.finish_reason == "error":
        raise failure(final)
    return "".join(parts), final


async def wait_for_slot(stream: Any, request: Request, n_slots: int) -> Response | None:
    """None once a slot took the request; a 503 with Retry-After if none did within --queue-timeout; a 499 if the
    client left while it waited (the request leaves the queue at once, not when a slot frees)."""
    timeout = server_state(request).config.queue_timeout
    if timeout <= 0:
        return None  # the response's own stream watches the client from here
    started = asyncio.ensure_future(stream.wait_started(timeout))
    gone = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({started, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not started.done():
            started.cancel()
    if started.done() and not started.cancelled() and started.result():
        return None
    stream.cancel()
    if not started.done() or started.cancelled():
        log.info("%s: client disconnected while queued, request dropped", stream.request_id)
        return Response(status_code=499)
    log.info("%s: no slot free within --queue-timeout %g s, refused", stream.request_id, timeout)
    err = ApiError(503, f"the server is busy: no slot became free within {timeout:g} s (--queue-timeout; "
                   f"{n_slots} slot{'s' if n_slots != 1 else ''}, see --parallel); retry in {RETRY_AFTER_S} s")
    return error_response(err, headers={"Retry-After": str(RETRY_AFTER_S)}, path=request.url.path)


def remember_answer(request: Request, tokenizer: Any, final: TokenEvent, in_thought: bool = False) -> None:
    """Keep the ids generated for a finished answer, for the turn that sends it back (engine.server.answer_ids).
    An answer a stop string cut is not the text of its ids, and is not kept. `in_thought`: the prompt opened a
    thinking model's thought."""
    if final.finish_reason in ("stop", "length") and final.stop_string is None and final.generated:
        answers = server_state(request).prompt_ids.answers
        if is_harmony(tokenizer):  # the client gets (and sends back) each message's body, not the whole output
            for body in message_bodies(tokenizer, final.generated):
                answers.remember(tokenizer, body)
            return
        thinking = getattr(tokenizer, "thinking", None)
        if thinking is not None:  # the client gets (and sends back) the thought and the answer apart
            for part in answer_parts(tokenizer, thinking, final.generated, in_thought):
                answers.remember(tokenizer, part)
            return
        answers.remember(tokenizer, final.generated)


def reasoning_token_count(tokenizer: Any, final: TokenEvent, in_thought: bool = False) -> int:
    """The answer's reasoning tokens, where its format marks them (harmony's `analysis`, a thinking model's thought;
    `in_thought`: the prompt opened it); 0 otherwise."""
    if is_harmony(tokenizer):
        return reasoning_tokens(tokenizer, final.generated or [])
    thinking = getattr(tokenizer, "thinking", None)
    return 0 if thinking is None else thought_tokens(tokenizer, thinking, final.generated or [], in_thought)


def sse_response(chunks: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream", headers=SSE_HEADERS)
