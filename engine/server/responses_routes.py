"""OpenAI's Responses API: `POST /v1/responses` (streaming or not, function tools, stored responses continued with
`previous_response_id`), `GET` and `DELETE /v1/responses/{id}`, as the openai SDK's `client.responses` and Codex
use them. Errors are OpenAI's shape. Stored responses: engine.server.response_store (in memory, the most recent
256, until the engine stops).

Usage: `input_tokens` is the whole prompt, `input_tokens_details.cached_tokens` what the engine did not recompute.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from engine.errors import ApiError
from engine.runtime.requests import GenerationRequest, SamplingParams, TokenEvent, Usage
from engine.server.conversation_attrs import template_attrs
from engine.server.effort import openai_thinking, responses_effort
from engine.server.generation import (
    collect,
    failure,
    reasoning_token_count,
    remember_answer,
    sse_response,
    wait_for_slot,
)
from engine.server.harmony import Piece
from engine.server.model_output import output_stream, parse_output
from engine.server.prompt_tokens import PromptIds, RenderedPrompt
from engine.server.prompts import render_prompt
from engine.server.response_store import StoredResponse
from engine.server.responses_schemas import ResponsesRequest, function_tools, input_messages
from engine.server.schemas import parse_body
from engine.server.state import require_engine, server_state
from engine.server.streaming import (
    KEEPALIVE_S,
    SSE_KEEPALIVE,
    ClientDisconnected,
    engine_events,
    with_heartbeat,
)
from engine.server.tool_calls import ParsedOutput

log = logging.getLogger("strata.server")
router = APIRouter()


def usage_dict(usage: Usage | None, reasoning: int = 0) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


@dataclass
class Turn:
    """One request on its way: its id, what it was asked, and what it answered so far."""

    response_id: str
    req: ResponsesRequest
    model: str
    history: list[dict[str, Any]]  # earlier turns (previous_response_id) and this input, without instructions
    created: int = field(default_factory=lambda: int(time.time()))

    def body(self, status: str, output: list[dict[str, Any]], usage: Usage | None = None,
             incomplete: str | None = None, error: dict[str, Any] | None = None, reasoning: int = 0) -> dict[str, Any]:
        r = self.req
        return {
            "id": self.response_id, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": output, "usage": usage_dict(usage, reasoning), "error": error,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "previous_response_id": r.previous_response_id, "temperature": r.temperature, "top_p": r.top_p,
            "tool_choice": r.tool_choice if r.tool_choice is not None else "auto", "tools": r.tools or [],
            "parallel_tool_calls": r.parallel_tool_calls if r.parallel_tool_calls is not None else True,
            "store": r.store is not False, "text": r.text or {"format": {"type": "text"}},
            "reasoning": r.reasoning or {}, "metadata": r.metadata or {}, "truncation": "disabled",
        }


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    """A message output item: its text as one output_text part, none while in progress (the added event's)."""
    assert status in ("in_progress", "completed", "incomplete"), status
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [] if status == "in_progress" else [{"type": "output_text", "text": text, "annotations": []}]}


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if status == "completed" else []}


def call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
            "name": call["function"]["name"],
            "arguments": call["function"]["arguments"] if status == "completed" else "", "status": status}


def _sampling(req: ResponsesRequest) -> SamplingParams:
    params = SamplingParams(max_tokens=req.max_output_tokens)
    if req.temperature is not None:
        params.temperature = req.temperature
    if req.top_p is not None:
        params.top_p = req.top_p
    return params


def _prompt(tokenizer: Any, req: ResponsesRequest, earlier: list[dict[str, Any]], ids: PromptIds
            ) -> tuple[RenderedPrompt, list[dict[str, Any]], list[dict[str, Any]] | None]:
    history = earlier + input_messages(req.input)
    if not history:
        raise ApiError(400, "'input' must contain at least one item", param="input")
    tools = function_tools(req)
    instructions = [{"role": "system", "content": req.instructions}] if req.instructions else []
    prompt = render_prompt(tokenizer, instructions + history, tools, ids, responses_effort(req.reasoning),
                           openai_thinking((req.reasoning or {}).get("effort")))
    return prompt, history, tools


def _finish(turn: Turn, parsed: ParsedOutput, final: TokenEvent, message_id: str, reasoning: int) -> dict[str, Any]:
    """The finished response object: completed, or incomplete when max_output_tokens (or the context) ended it."""
    incomplete = "max_output_tokens" if final.finish_reason == "length" and not parsed.tool_calls else None
    output = [reasoning_item("rs_" + message_id.removeprefix("msg_"), parsed.reasoning)] if parsed.reasoning else []
    # the message a limit cut is itself incomplete, as OpenAI marks it
    output += [message_item(message_id, parsed.content, "incomplete" if incomplete else "completed")
               ] if parsed.content else []
    output += [call_item(call) for call in parsed.tool_calls]
    return turn.body("incomplete" if incomplete else "completed", output, final.usage, incomplete, reasoning=reasoning)


def _store(request: Request, turn: Turn, parsed: ParsedOutput, body: dict[str, Any]) -> None:
    """Keeps the turn's conversation for a follow-up's previous_response_id, unless the request said store: false."""
    if turn.req.store is False:
        return
    answer: dict[str, Any] = {"role": "assistant", "content": parsed.content or ""}
    if parsed.reasoning:
        answer["reasoning_content"] = parsed.reasoning  # harmony keeps it within a tool loop
    if parsed.tool_calls:
        answer["tool_calls"] = parsed.tool_calls
    server_state(request).responses.put(turn.response_id, StoredResponse([*turn.history, answer], body))


@router.post("/v1/responses")
@router.post("/responses", include_in_schema=False)
async def responses(request: Request) -> Response:
    engine = require_engine(request)
    req = await run_in_threadpool(parse_body, ResponsesRequest, await request.body())
    earlier: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        stored = server_state(request).responses.get(req.previous_response_id)
        if stored is None:
            raise ApiError(400, f"previous response {req.previous_response_id!r} not found: stored responses are "
                           "kept in memory, the most recent 256, until the engine stops; send the whole input "
                           "instead", param="previous_response_id")
        earlier = stored.history
    prompt, history, tools = await run_in_threadpool(_prompt, engine.tokenizer, req, earlier,
                                                     server_state(request).prompt_ids)
    attrs = template_attrs(history, req.metadata, request.headers, "Responses")
    turn = Turn("resp_" + uuid.uuid4().hex, req, req.model or engine.model_name, history)
    stream = engine.submit(GenerationRequest(turn.response_id, prompt.ids, _sampling(req), attrs, prompt.rewritten_at,
                                             prompt.past_reasoning))
    refused = await wait_for_slot(stream, request, engine.n_slots)
    if refused is not None:
        return refused
    if req.stream:
        return sse_response(_events(stream, request, turn, tools, engine.tokenizer, prompt.in_thought))
    try:
        text, final = await collect(stream, request)
    except ClientDisconnected:
        log.info("%s: client disconnected, request cancelled", turn.response_id)
        return Response(status_code=499)
    remember_answer(request, engine.tokenizer, final, prompt.in_thought)
    parsed = parse_output(engine.tokenizer, text, tools, prompt.in_thought)
    body = _finish(turn, parsed, final, "msg_" + uuid.uuid4().hex, reasoning_token_count(engine.tokenizer, final,
                                                                                    prompt.in_thought))
    _store(request, turn, parsed, body)
    return JSONResponse(body)


class _Events:
    """Numbers the stream's events (`sequence_number`, as the SDK expects)."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, kind: str, body: dict[str, Any]) -> str:
        event = {"type": kind, "sequence_number": self.n, **body}
        self.n += 1
        return f"event: {kind}\ndata: " + json.dumps(event, ensure_ascii=False, separators=(",", ":")) + "\n\n"


class _Items:
    """The streamed reasoning and message items: an item opens on its first delta and is done when the other kind
    starts (or the answer ends); each keeps its own output_index."""

    def __init__(self, ev: _Events, message_id: str) -> None:
        self.ev = ev
        self.index = 0  # the next item's output_index
        self.message_id = message_id
        self.reasoning_id = "rs_" + message_id.removeprefix("msg_")
        self.text: dict[str, list[str]] = {"reasoning": [], "content": []}
        self._open: str | None = None

    def _where(self) -> dict[str, Any]:
        item_id = self.reasoning_id if self._open == "reasoning" else self.message_id
        return {"item_id": item_id, "output_index": self.index, "content_index": 0}

    def write(self, piece: Piece) -> list[str]:
        kind, text = piece
        ev = self.ev
        out = self.close() if self._open not in (None, kind) else []
        if self._open is None:
            self._open = kind
            if kind == "reasoning":
                out.append(ev("response.output_item.added", {"output_index": self.index, "item": reasoning_item(
                    self.reasoning_id, "", "in_progress")}))
            else:
                out.append(ev("response.output_item.added", {"output_index": self.index, "item": message_item(
                    self.message_id, "", "in_progress")}))
                out.append(ev("response.content_part.added", {**self._where(), "part": {
                    "type": "output_text", "text": "", "annotations": []}}))
        self.text[kind].append(text)
        kind_event = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        out.append(ev(kind_event, {**self._where(), "delta": text, "logprobs": []} if kind == "content" else
                      {**self._where(), "delta": text}))
        return out

    def close(self, status: str = "completed") -> list[str]:
        """The open item's done events; `status` that of a message item the answer's end closes."""
        if self._open is None:
            return []
        ev, where = self.ev, self._where()
        text = "".join(self.text[self._open])
        if self._open == "reasoning":
            out = [ev("response.reasoning_text.done", {**where, "text": text}),
                   ev("response.output_item.done", {"output_index": self.index,
                                                    "item": reasoning_item(self.reasoning_id, text)})]
        else:
            part = {"type": "output_text", "text": text, "annotations": []}
            out = [ev("response.output_text.done", {**where, "text": text, "logprobs": []}),
                   ev("response.content_part.done", {**where, "part": part}),
                   ev("response.output_item.done", {"output_index": self.index,
                                                    "item": message_item(self.message_id, text, status)})]
        self._open = None
        self.index += 1
        return out


async def _events(stream: Any, request: Request, turn: Turn, tools: list[dict[str, Any]] | None, tokenizer: Any,
                  in_thought: bool) -> AsyncIterator[str]:
    """response.created / in_progress; a reasoning item whose text streams as deltas (a model that marks its
    reasoning), a message item whose output_text streams as deltas; a function_call item per call (its arguments as
    one delta); then response.completed (or .incomplete, or .failed)."""
    ev = _Events()
    items = _Items(ev, "msg_" + uuid.uuid4().hex)
    reader = output_stream(tokenizer, tools, in_thought)
    final: TokenEvent | None = None
    yield ev("response.created", {"response": turn.body("in_progress", [])})
    yield ev("response.in_progress", {"response": turn.body("in_progress", [])})
    try:
        async with contextlib.aclosing(engine_events(stream, request)) as events:
            async for event in with_heartbeat(events, KEEPALIVE_S):
                if event is None:  # the prompt is still being computed
                    yield SSE_KEEPALIVE
                    continue
                for piece in reader.feed(event.text):
                    for out in items.write(piece):
                        yield out
                if event.finish_reason is not None:
                    final = event
    except ClientDisconnected:
        log.info("%s: client disconnected, stream cancelled", turn.response_id)
        return
    finally:
        if final is None:  # the response ended before the engine did: free the slot
            stream.cancel()
    if final is None or final.finish_reason == "error":
        err = failure(final)
        yield ev("response.failed", {"response": turn.body("failed", [], error={
            "code": "server_error", "message": err.message})})
        return
    remember_answer(request, tokenizer, final, in_thought)
    rest, tool_calls = reader.finish()
    for piece in rest:
        for out in items.write(piece):
            yield out
    for out in items.close("incomplete" if final.finish_reason == "length" and not tool_calls else "completed"):
        yield out
    reasoning, content = ("".join(items.text[k]) for k in ("reasoning", "content"))
    parsed = ParsedOutput(content or None, tool_calls, reasoning or None)
    for i, call in enumerate(tool_calls, start=items.index):
        item = call_item(call)
        yield ev("response.output_item.added", {"output_index": i, "item": call_item(call, "in_progress")})
        yield ev("response.function_call_arguments.delta", {"item_id": item["id"], "output_index": i,
                                                            "delta": item["arguments"]})
        yield ev("response.function_call_arguments.done", {"item_id": item["id"], "output_index": i,
                                                           "arguments": item["arguments"]})
        yield ev("response.output_item.done", {"output_index": i, "item": item})
    body = _finish(turn, parsed, final, items.message_id, reasoning_token_count(tokenizer, final, in_thought))
    _store(request, turn, parsed, body)
    yield ev("response.incomplete" if body["status"] == "incomplete" else "response.completed", {"response": body})


@router.get("/v1/responses/{response_id}")
@router.get("/responses/{response_id}", include_in_schema=False)
async def get_response(response_id: str, request: Request) -> dict[str, Any]:
    stored = server_state(request).responses.get(response_id)
    if stored is None:
        raise ApiError(404, f"response {response_id!r} not found: stored responses are kept in memory, the most "
                       "recent 256, until the engine stops", param="response_id")
    return stored.body


@router.delete("/v1/responses/{response_id}")
@router.delete("/responses/{response_id}", include_in_schema=False)
async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
    if not server_state(request).responses.delete(response_id):
        raise ApiError(404, f"response {response_id!r} not found", param="response_id")
    return {"id": response_id, "object": "response.deleted", "deleted": True}

