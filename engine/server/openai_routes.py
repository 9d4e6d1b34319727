"""The OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models (also without /v1)."""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from engine.errors import ApiError
from engine.runtime.requests import GenerationRequest, TokenEvent, Usage
from engine.server.conversation_attrs import chat_attrs, completion_attrs
from engine.server.errors import error_body
from engine.server.generation import (
    collect,
    failure,
    reasoning_token_count,
    remember_answer,
    sse_response,
    wait_for_slot,
)
from engine.server.model_output import output_stream, parse_output
from engine.server.prompts import chat_prompt, completion_prompt
from engine.server.schemas import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    check_common,
    parse_body,
    sampling_params,
)
from engine.server.state import require_engine, server_state
from engine.server.streaming import (
    KEEPALIVE_S,
    SSE_DONE,
    SSE_KEEPALIVE,
    ClientDisconnected,
    engine_events,
    sse,
    with_heartbeat,
)

log = logging.getLogger("strata.server")
router = APIRouter()


def usage_dict(usage: Usage | None, reasoning: int = 0) -> dict[str, Any] | None:
    """OpenAI's usage object; cached_tokens counts prompt tokens the engine did not recompute, reasoning_tokens (only
    where the model marks its reasoning) the completion tokens spent on it."""
    if usage is None:
        return None
    out: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }
    if reasoning:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return out


def _error_event(err: ApiError) -> str:
    # The openai SDK raises APIError on a `data:` event carrying an "error" object.
    return sse(error_body(err.message, err.type, err.param, err.status))


# ---------------------------------------------------------------------------------------------- chat


@router.post("/v1/chat/completions")
@router.post("/chat/completions", include_in_schema=False)
async def chat_completions(request: Request) -> Response:
    engine = require_engine(request)
    # Parsing and tokenising a large prompt takes seconds: on a worker thread, so every other route keeps answering.
    req = await run_in_threadpool(parse_body, ChatCompletionRequest, await request.body())
    check_common(req)
    attrs = chat_attrs(req, request.headers)
    prompt, tools = await run_in_threadpool(chat_prompt, engine.tokenizer, req, server_state(request).prompt_ids)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = sampling_params(req, max_tokens, engine.ctx_size)
    request_id = "chatcmpl-" + uuid.uuid4().hex
    stream = engine.submit(GenerationRequest(request_id, prompt.ids, params, attrs, prompt.rewritten_at,
                                             prompt.past_reasoning))
    refused = await wait_for_slot(stream, request, engine.n_slots)
    if refused is not None:
        return refused
    created = int(time.time())
    if req.stream:
        return sse_response(_chat_chunks(stream, request, request_id, created, engine.model_name,
                                         tools, req.include_usage(), engine.tokenizer, prompt.in_thought))
    try:
        text, final = await collect(stream, request)
    except ClientDisconnected:
        log.info("%s: client disconnected, request cancelled", request_id)
        return Response(status_code=499)
    remember_answer(request, engine.tokenizer, final, prompt.in_thought)
    parsed = parse_output(engine.tokenizer, text, tools, prompt.in_thought)
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.reasoning is not None:
        message["reasoning_content"] = parsed.reasoning  # llama.cpp's, vLLM's and DeepSeek's field
    finish_reason = final.finish_reason
    if parsed.tool_calls:
        message["tool_calls"] = parsed.tool_calls
        finish_reason = "tool_calls"
    return JSONResponse({
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": engine.model_name,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}],
        "usage": usage_dict(final.usage, reasoning_token_count(engine.tokenizer, final, prompt.in_thought)),
    })


_DELTA_FIELD = {"content": "content", "reasoning": "reasoning_content"}


async def _chat_chunks(stream: Any, request: Request, request_id: str, created: int, model: str,
                       tools: list[dict[str, Any]] | None, include_usage: bool, tokenizer: Any,
                       in_thought: bool) -> AsyncIterator[str]:
    base = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> str:
        body: dict[str, Any] = {**base, "choices": [
            {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
        if include_usage:
            body["usage"] = None
        return sse(body)

    reader = output_stream(tokenizer, tools, in_thought)
    final: TokenEvent | None = None
    try:
        yield chunk({"role": "assistant", "content": ""})
        async with contextlib.aclosing(engine_events(stream, request)) as events:
            async for event in with_heartbeat(events, KEEPALIVE_S):
                if event is None:  # the prompt is still being computed
                    yield SSE_KEEPALIVE
                    continue
                for kind, text in reader.feed(event.text):
                    yield chunk({_DELTA_FIELD[kind]: text})
                if event.finish_reason is not None:
                    final = event
    except ClientDisconnected:
        log.info("%s: client disconnected, stream cancelled", request_id)
        return
    finally:
        if final is None:  # the response ended before the engine did: free the slot
            stream.cancel()
    if final is None or final.finish_reason == "error":
        yield _error_event(failure(final))
        return
    remember_answer(request, tokenizer, final, in_thought)
    finish_reason = final.finish_reason
    rest, tool_calls = reader.finish()
    for kind, text in rest:
        yield chunk({_DELTA_FIELD[kind]: text})
    if tool_calls:
        yield chunk({"tool_calls": [{"index": i, **call} for i, call in enumerate(tool_calls)]})
        finish_reason = "tool_calls"
    yield chunk({}, finish_reason)
    if include_usage:
        yield sse({**base, "choices": [], "usage": usage_dict(final.usage, reasoning_token_count(tokenizer, final, in_thought))})
    yield SSE_DONE


# ---------------------------------------------------------------------------------------------- completions


@router.post("/v1/completions")
@router.post("/completions", include_in_schema=False)
async def completions(request: Request) -> Response:
    engine = require_engine(request)
    req = await run_in_threadpool(parse_body, CompletionRequest, await request.body())
    check_common(req)
    if req.best_of is not None and req.best_of != 1:
        raise ApiError(400, f"best_of other than 1 is not supported (got {req.best_of})", param="best_of")
    attrs = completion_attrs(req, request.headers)
    prompt = await run_in_threadpool(completion_prompt, engine.tokenizer, req.prompt)
    params = sampling_params(req, req.max_tokens if req.max_tokens is not None else COMPLETION_DEFAULT_MAX_TOKENS, engine.ctx_size)
    request_id = "cmpl-" + uuid.uuid4().hex
    stream = engine.submit(GenerationRequest(request_id, prompt, params, attrs))
    refused = await wait_for_slot(stream, request, engine.n_slots)
    if refused is not None:
        return refused
    created = int(time.time())
    echo = await run_in_threadpool(engine.tokenizer.decode, prompt) if req.echo else ""
    if req.stream:
        return sse_response(_completion_chunks(stream, request, request_id, created, engine.model_name, echo,
                                                req.include_usage()))
    try:
        text, final = await collect(stream, request)
    except ClientDisconnected:
        log.info("%s: client disconnected, request cancelled", request_id)
        return Response(status_code=499)
    return JSONResponse({
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": engine.model_name,
        "choices": [{"index": 0, "text": echo + text, "logprobs": None, "finish_reason": final.finish_reason}],
        "usage": usage_dict(final.usage),
    })


async def _completion_chunks(stream: Any, request: Request, request_id: str, created: int, model: str, echo: str,
                             include_usage: bool) -> AsyncIterator[str]:
    base = {"id": request_id, "object": "text_completion", "created": created, "model": model}

    def chunk(text: str, finish_reason: str | None = None) -> str:
        body: dict[str, Any] = {**base, "choices": [
            {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}
        if include_usage:
            body["usage"] = None
        return sse(body)

    final: TokenEvent | None = None
    try:
        if echo:
            yield chunk(echo)
        async with contextlib.aclosing(engine_events(stream, request)) as events:
            async for event in with_heartbeat(events, KEEPALIVE_S):
                if event is None:  # the prompt is still being computed: bytes, so no idle timeout cuts it
                    yield SSE_KEEPALIVE
                    continue
                if event.text:
                    yield chunk(event.text)
                if event.finish_reason is not None:
                    final = event
    except ClientDisconnected:
        log.info("%s: client disconnected, stream cancelled", request_id)
        return
    finally:
        if final is None:  # the response ended before the engine did: free the slot
            stream.cancel()
    if final is None or final.finish_reason == "error":
        yield _error_event(failure(final))
        return
    yield chunk("", final.finish_reason)
    if include_usage:
        yield sse({**base, "choices": [], "usage": usage_dict(final.usage)})
    yield SSE_DONE


# ---------------------------------------------------------------------------------------------- models


def _model_card(request: Request) -> dict[str, Any]:
    engine = require_engine(request)
    return {"id": engine.model_name, "object": "model", "created": server_state(request).started,
            "owned_by": "strata", "meta": {"n_ctx": engine.ctx_size, "n_slots": engine.n_slots}}


@router.get("/v1/models")
@router.get("/models", include_in_schema=False)
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(request)]}


@router.get("/v1/models/{model_id:path}")
@router.get("/models/{model_id:path}", include_in_schema=False)
async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    # Any name is the served model: agents ask for the names they were built for (Claude Code for a small, fast
    # one beside the main one), and a 404 here stops them.
    return {**_model_card(request), "id": model_id}
