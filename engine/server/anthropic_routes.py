"""Anthropic's Messages API: `POST /v1/messages` (streaming or not, tools) and `POST /v1/messages/count_tokens`,
as Anthropic's SDKs and Claude Code use them. Errors come in Anthropic's shape (engine.server.errors).

Usage: `input_tokens` counts the prompt tokens computed for this request, `cache_read_input_tokens` those the
engine did not recompute (its live slot or the conversation cache), so the two add up to the prompt as Anthropic's
do; `cache_creation_input_tokens` is 0: every conversation is kept by the conversation cache without being asked.
"""

from __future__ import annotations

import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from engine.runtime.requests import GenerationRequest, SamplingParams, TokenEvent, Usage
from engine.server.anthropic_schemas import (
    CountTokensRequest,
    MessagesRequest,
    function_tools,
    template_messages,
    tool_input,
)
from engine.server.conversation_attrs import template_attrs
from engine.server.effort import messages_effort, messages_thinking
from engine.server.errors import anthropic_error_body
from engine.server.generation import collect, failure, remember_answer, sse_response, wait_for_slot
from engine.server.harmony import Piece
from engine.server.model_output import output_stream, parse_output
from engine.server.prompt_tokens import PromptIds, RenderedPrompt
from engine.server.prompts import render_prompt
from engine.server.schemas import parse_body
from engine.server.state import require_engine, server_state
from engine.server.streaming import ClientDisconnected, engine_events, with_heartbeat

log = logging.getLogger("strata.server")
router = APIRouter()
PING_INTERVAL_S = 10.0  # a ping this often while nothing else is sent (a long prefill), as Anthropic's API does


def usage_dict(usage: Usage | None) -> dict[str, int]:
    prompt, cached, done = (usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens) if usage else (0, 0, 0)
    return {"input_tokens": prompt - cached, "output_tokens": done, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached}


def stop_reason(final: TokenEvent, called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished request."""
    if called:
        return "tool_use", None
    if final.stop_string is not None:
        return "stop_sequence", final.stop_string
    return ("max_tokens" if final.finish_reason == "length" else "end_turn"), None


def tool_use_block(call: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": call["function"]["name"],
            "input": tool_input(call["function"]["arguments"])}


def thinking_block(text: str) -> dict[str, Any]:
    # The signature Anthropic's API seals thinking with: none here, and none is checked when it comes back.
    return {"type": "thinking", "thinking": text, "signature": ""}


def _sampling(req: MessagesRequest) -> SamplingParams:
    params = SamplingParams(max_tokens=req.max_tokens, stop=[s for s in req.stop_sequences or [] if s])
    if req.temperature is not None:
        params.temperature = req.temperature
    if req.top_p is not None:
        params.top_p = req.top_p
    if req.top_k is not None:
        params.top_k = req.top_k
    return params


def messages_prompt(tokenizer: Any, req: MessagesRequest | CountTokensRequest, ids: PromptIds | None = None
                    ) -> tuple[RenderedPrompt, list[dict[str, Any]], list[dict[str, Any]] | None]:
    """A Messages request's prompt as the route renders it, with its turns and tools in chat-template form."""
    messages = template_messages(req)
    tools = function_tools(req)
    effort = messages_effort(req.thinking, req.output_config)
    # A last assistant message with text is the start of the answer (Anthropic's prefill): the answer goes on from it.
    final = messages[-1]
    prefill = final["role"] == "assistant" and bool(final.get("content", "").strip()) and "tool_calls" not in final
    return render_prompt(tokenizer, messages, tools, ids, effort, messages_thinking(req.thinking),
                         continue_final=prefill), messages, tools


@router.post("/v1/messages")
@router.post("/messages", include_in_schema=False)
async def messages(request: Request) -> Response:
    engine = require_engine(request)
    req = await run_in_threadpool(parse_body, MessagesRequest, await request.body())
    prompt, turns, tools = await run_in_threadpool(messages_prompt, engine.tokenizer, req, server_state(request).prompt_ids)
    attrs = template_attrs(turns, req.metadata, request.headers, "Messages")
    message_id = "msg_" + uuid.uuid4().hex
    stream = engine.submit(GenerationRequest(message_id, prompt.ids, _sampling(req), attrs, prompt.rewritten_at,
                                             prompt.past_reasoning))
    refused = await wait_for_slot(stream, request, engine.n_slots)
    if refused is not None:
        return refused
    model = req.model or engine.model_name
    if req.stream:
        return sse_response(_events(stream, request, message_id, model, len(prompt.ids), tools, engine.tokenizer,
                                    prompt.in_thought))
    try:
        text, final = await collect(stream, request)
    except ClientDisconnected:
        log.info("%s: client disconnected, request cancelled", message_id)
        return Response(status_code=499)
    remember_answer(request, engine.tokenizer, final, prompt.in_thought)
    parsed = parse_output(engine.tokenizer, text, tools, prompt.in_thought)
    content: list[dict[str, Any]] = [thinking_block(parsed.reasoning)] if parsed.reasoning else []
    content += [{"type": "text", "text": parsed.content}] if parsed.content else []
    content += [tool_use_block(call) for call in parsed.tool_calls]
    reason, sequence = stop_reason(final, bool(parsed.tool_calls))
    return JSONResponse({"id": message_id, "type": "message", "role": "assistant", "model": model,
                         "content": content, "stop_reason": reason, "stop_sequence": sequence,
                         "usage": usage_dict(final.usage)})


def _event(kind: str, body: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: " + json.dumps({"type": kind, **body}, ensure_ascii=False,
                                                 separators=(",", ":")) + "\n\n"


class _Blocks:
    """The streamed thinking and text blocks: a block opens on its first delta and closes when the other kind starts
    (or the answer ends)."""

    _START = {"reasoning": {"type": "thinking", "thinking": ""}, "content": {"type": "text", "text": ""}}

    def __init__(self) -> None:
        self.index = 0  # the next block's index
        self._open: str | None = None

    def write(self, piece: Piece) -> list[str]:
        kind, text = piece
        out = self.close() if self._open not in (None, kind) else []
        if self._open is None:
            self._open = kind
            out.append(_event("content_block_start", {"index": self.index, "content_block": self._START[kind]}))
        delta = {"type": "thinking_delta", "thinking": text} if kind == "reasoning" else \
            {"type": "text_delta", "text": text}
        out.append(_event("content_block_delta", {"index": self.index, "delta": delta}))
        return out

    def close(self) -> list[str]:
        if self._open is None:
            return []
        out = []
        if self._open == "reasoning":
            out.append(_event("content_block_delta", {"index": self.index,
                                                      "delta": {"type": "signature_delta", "signature": ""}}))
        out.append(_event("content_block_stop", {"index": self.index}))
        self._open = None
        self.index += 1
        return out


async def _events(stream: Any, request: Request, message_id: str, model: str, n_prompt: int,
                  tools: list[dict[str, Any]] | None, tokenizer: Any, in_thought: bool) -> AsyncIterator[str]:
    """Anthropic's event sequence: message_start and a ping at once, pings while the prompt is computed, a text
    block's start/deltas/stop, a block per tool call, message_delta (stop_reason, the final usage: what the cache
    reused is known only once the prompt is in), message_stop. An engine failure ends with an error event."""
    reader = output_stream(tokenizer, tools, in_thought)
    blocks = _Blocks()
    final: TokenEvent | None = None
    yield _event("message_start", {"message": {
        "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": usage_dict(Usage(n_prompt, 0, 0))}})
    yield _event("ping", {})
    try:
        async with contextlib.aclosing(engine_events(stream, request)) as events:
            async for event in with_heartbeat(events, PING_INTERVAL_S):
                if event is None:
                    yield _event("ping", {})
                    continue
                for piece in reader.feed(event.text):
                    for out in blocks.write(piece):
                        yield out
                if event.finish_reason is not None:
                    final = event
    except ClientDisconnected:
        log.info("%s: client disconnected, stream cancelled", message_id)
        return
    finally:
        if final is None:  # the response ended before the engine did: free the slot
            stream.cancel()
    if final is None or final.finish_reason == "error":
        yield _event("error", {"error": anthropic_error_body(failure(final))["error"]})
        return
    remember_answer(request, tokenizer, final, in_thought)
    rest, tool_calls = reader.finish()
    for piece in rest:
        for out in blocks.write(piece):
            yield out
    for out in blocks.close():
        yield out
    index = blocks.index
    for call in tool_calls:
        block = tool_use_block(call)
        yield _event("content_block_start", {"index": index, "content_block": {**block, "input": {}}})
        yield _event("content_block_delta", {"index": index, "delta": {
            "type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}})
        yield _event("content_block_stop", {"index": index})
        index += 1
    reason, sequence = stop_reason(final, bool(tool_calls))
    yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                   "usage": usage_dict(final.usage)})
    yield _event("message_stop", {})


@router.post("/v1/messages/count_tokens")
@router.post("/messages/count_tokens", include_in_schema=False)
async def count_tokens(request: Request) -> dict[str, int]:
    engine = require_engine(request)
    req = await run_in_threadpool(parse_body, CountTokensRequest, await request.body())
    prompt, _, _ = await run_in_threadpool(messages_prompt, engine.tokenizer, req)
    return {"input_tokens": len(prompt.ids)}
