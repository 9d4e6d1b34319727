"""The OpenAPI document served at /openapi.json.

The routes read their bodies themselves (to give OpenAI-shaped errors naming the field), so FastAPI cannot see
what they take. This module adds it from the same pydantic models and settings table the routes validate with:
request bodies, query parameters, the error shape every failure uses, and /metrics' Prometheus text as the
alternative to its JSON.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from engine import __version__
from engine.cache.attrs import PRIORITIES
from engine.config import LIVE_SETTINGS, setting_of
from engine.runtime.explain import REQUEST_LOG_SIZE
from engine.server.anthropic_schemas import CountTokensRequest, MessagesRequest
from engine.server.control_routes import PurgeRequest, SlotFileRequest
from engine.server.prometheus import MEDIA_TYPE as PROMETHEUS_TEXT
from engine.server.responses_schemas import ResponsesRequest
from engine.server.schemas import ChatCompletionRequest, CompletionRequest

REF = "#/components/schemas/{model}"

ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["integer", "string", "null"]}}}},
}


def _setting_schema(name: str) -> dict[str, Any]:
    spec = setting_of(name)
    if spec.kind == "int":
        out: dict[str, Any] = {"type": "integer"}
    elif spec.kind == "float":
        out = {"type": "number"}
    elif spec.kind == "bool":
        out = {"type": "boolean"}
    elif spec.kind == "choice":
        return {"type": "string", "enum": list(spec.choices), "description": spec.help}
    else:
        return {"type": "string", "description": spec.help}
    if spec.minimum is not None:
        out["minimum"] = spec.minimum
    if spec.maximum is not None:
        out["maximum"] = spec.maximum
    return {**out, "description": spec.help}


def _body(model: type[BaseModel] | dict[str, Any], components: dict[str, Any], required: bool = True) -> dict:
    if isinstance(model, dict):
        schema = model
    else:
        schema = model.model_json_schema(ref_template=REF)
        components.update(schema.pop("$defs", {}))
        components[model.__name__] = schema
        schema = {"$ref": REF.format(model=model.__name__)}
    return {"required": required, "content": {"application/json": {"schema": schema}}}


def _query(name: str, schema: dict[str, Any], required: bool = False) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": required, "schema": schema}


def build_openapi(app: FastAPI) -> dict[str, Any]:
    """The document for `app`: FastAPI's routes plus bodies, query parameters and error responses."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    doc = get_openapi(title="Strata", version=__version__, routes=app.routes,
                      description="OpenAI-compatible LLM server with a conversation cache; see docs/API.md.")
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    components["Error"] = ERROR_SCHEMA
    live = {"type": "object", "minProperties": 1, "additionalProperties": False,
            "properties": {name: _setting_schema(name) for name in LIVE_SETTINGS}}
    conversation = {"type": "object", "minProperties": 1, "additionalProperties": False,
                    "properties": {"priority": {"type": "string", "enum": list(PRIORITIES)},
                                   "pinned": {"type": "boolean"}}}
    paths = doc["paths"]
    bodies = {
        ("/v1/chat/completions", "post"): _body(ChatCompletionRequest, components),
        ("/v1/completions", "post"): _body(CompletionRequest, components),
        ("/v1/messages", "post"): _body(MessagesRequest, components),
        ("/v1/messages/count_tokens", "post"): _body(CountTokensRequest, components),
        ("/v1/responses", "post"): _body(ResponsesRequest, components),
        ("/slots/{slot_id}", "post"): _body(SlotFileRequest, components, required=False),
        ("/cache/purge", "post"): _body(PurgeRequest, components, required=False),
        ("/cache/config", "put"): _body(live, components),
        ("/cache/conversations/{conv_id}", "patch"): _body(conversation, components),
    }
    queries = {
        ("/metrics", "get"): [_query("format", {"type": "string", "enum": ["json", "prometheus"]})],
        ("/cache/events", "get"): [_query("limit", {"type": "integer", "minimum": 1, "maximum": 10000})],
        ("/cache/requests", "get"): [_query("limit", {"type": "integer", "minimum": 1, "maximum": REQUEST_LOG_SIZE})],
        ("/slots/{slot_id}", "post"): [_query("action", {"type": "string", "enum": ["save", "restore", "erase"]},
                                              required=True)],
    }
    for path, methods in paths.items():
        for method, operation in methods.items():
            if (path, method) in bodies:
                operation["requestBody"] = bodies[(path, method)]
            operation.setdefault("parameters", []).extend(queries.get((path, method), []))
            if not operation["parameters"]:
                del operation["parameters"]
            operation["responses"].pop("422", None)  # validation failures are 400s here
            if (path, method) == ("/metrics", "get"):  # ?format=prometheus (or an Accept asking for it)
                operation["responses"]["200"]["content"][PROMETHEUS_TEXT] = {"schema": {"type": "string"}}
            operation["responses"]["default"] = {
                "description": "any failure, in OpenAI's error shape",
                "content": {"application/json": {"schema": {"$ref": REF.format(model="Error")}}}}
    app.openapi_schema = doc
    return doc
