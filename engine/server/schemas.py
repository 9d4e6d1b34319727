"""Request bodies of the OpenAI routes: parsed strictly, checked against documented ranges, turned into
`SamplingParams`. Unknown fields are ignored; a known field of the wrong type or out of range is a 400.

Sampling ranges (documented in docs/API.md): temperature [0, 2], top_p (0, 1], top_k >= 0 (0 = off),
min_p [0, 1], repeat_penalty (0, 10], presence/frequency_penalty [-2, 2], seed -1 (random) or
[0, 2**63 - 1], max_tokens / max_completion_tokens >= 1.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar, cast

from pydantic import BaseModel, ConfigDict, Field, GetCoreSchemaHandler, ValidationError
from pydantic_core import CoreSchema

from engine.errors import ApiError
from engine.runtime.requests import SamplingParams
from engine.server.errors import validation_error

MAX_STOP_STRINGS = 16
MAX_INT32 = 2**31 - 1
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


class StopAtFirstError:
    """Marks a list or map whose validation stops at its first bad item. A refusal names one error, but pydantic
    otherwise keeps one for every bad item, ~1 KB each: a 2 MB body holding a million wrong items took 1.3 GB and
    7 s to refuse. (pydantic's own FailFast cannot stand in a union: it is not hashable.)"""

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        return cast(CoreSchema, {**handler(source), "fail_fast": True})  # a list or dict schema: both take it


Items = Annotated[list[T], StopAtFirstError()]
Map = Annotated[dict[str, T], StopAtFirstError()]


class StrictBody(BaseModel):
    # Strict: "0.5" is not a number and true is not an integer. Unknown fields are ignored, as OpenAI clients
    # send parameters this server has no use for (user, logit_bias, parallel_tool_calls, ...).
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(StrictBody):
    include_usage: bool | None = None


class SamplingFields(StrictBody):
    """Parameters shared by /v1/chat/completions and /v1/completions (OpenAI's plus llama.cpp's extensions).

    Every optional field accepts null as "the default", as OpenAI's API does; the defaults are SamplingParams'.
    """

    model: str | None = None  # accepted and ignored: the server serves one model
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=MAX_INT32)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repeat_penalty: float | None = Field(None, gt=0.0, le=10.0)
    repeat_last_n: int | None = Field(None, ge=-1, le=MAX_INT32)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=-1, le=2**63 - 1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    stop: Any = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None
    # OpenAI's metadata (string values); the strata_ keys carry the conversation's priority, pin and client
    metadata: Map[str] | None = None

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class FunctionCall(StrictBody):
    name: str
    arguments: Any = None  # a JSON string as OpenAI sends it, or an object


class ToolCall(StrictBody):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(StrictBody):
    role: str
    content: Any = None
    name: str | None = None
    tool_calls: Items[ToolCall] | None = None
    tool_call_id: str | None = None
    # An assistant turn's reasoning as the client got it back (llama.cpp's, vLLM's and DeepSeek's field): templates
    # that write past reasoning (Qwen3's, within a tool loop) need it to render the turn as it was generated.
    reasoning_content: str | None = None


class FunctionDef(StrictBody):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(StrictBody):
    type: str = "function"
    function: FunctionDef


class ChatCompletionRequest(SamplingFields):
    messages: Items[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    tools: Items[Tool] | None = None
    tool_choice: Any = None
    reasoning_effort: Any = None  # low / medium / high (engine.server.effort reads and checks it)
    chat_template_kwargs: Any = None  # template variables (engine.server.template_kwargs reads and checks them)


class CompletionRequest(SamplingFields):
    prompt: Any
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT32)  # None: COMPLETION_DEFAULT_MAX_TOKENS
    echo: bool | None = None
    best_of: int | None = None


def parse_body(model: type[M], body: bytes) -> M:
    """Validate a raw JSON body, or raise a 400 that names the field, the expectation and the value."""
    if not body.strip():
        raise ApiError(400, "the request body is empty; expected a JSON object")
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


def check_common(req: SamplingFields) -> None:
    """Refusals that a field's type and range cannot express."""
    if req.n is not None and req.n != 1:
        if req.n > 1:
            raise ApiError(400, f"n > 1 is not supported (got n={req.n}): send one request per choice", param="n")
        raise ApiError(400, f"'n' must be 1, got {req.n}", param="n")


def stop_strings(raw: Any) -> list[str]:
    """`stop` as OpenAI accepts it: null, one string, or a list of strings (empty strings are dropped)."""
    if raw is None:
        return []
    if isinstance(raw, str):
        return [raw] if raw else []
    if isinstance(raw, list) and all(isinstance(s, str) for s in raw):
        if len(raw) > MAX_STOP_STRINGS:
            raise ApiError(400, f"'stop': at most {MAX_STOP_STRINGS} stop strings, got {len(raw)}", param="stop")
        return [s for s in raw if s]
    raise ApiError(400, f"'stop': expected a string or a list of strings, got {raw!r}"[:200], param="stop")


_PASSED_AS_IS = ("temperature", "top_p", "top_k", "min_p", "repeat_penalty", "presence_penalty",
                 "frequency_penalty")


def sampling_params(req: SamplingFields, max_tokens: int | None, ctx_size: int) -> SamplingParams:
    """The engine's view of a validated request; fields left out or null keep SamplingParams' defaults."""
    params = SamplingParams(max_tokens=max_tokens, stop=stop_strings(req.stop), ignore_eos=bool(req.ignore_eos))
    for name in _PASSED_AS_IS:
        value = getattr(req, name)
        if value is not None:
            setattr(params, name, value)
    if req.repeat_last_n is not None:
        params.repeat_last_n = ctx_size if req.repeat_last_n == -1 else req.repeat_last_n
    if req.seed is not None and req.seed != -1:  # llama.cpp: -1 = random
        params.seed = req.seed
    return params
