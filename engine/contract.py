"""The JSON bodies the engine serves to the desktop, as typed dataclasses: one source for both sides.

The server builds each body from these types (`to_json`), the desktop parses each answer with `parse`, which
is strict: a missing field, a field of the wrong type or an unknown field is a `ContractError` naming the body,
the field, what was expected and what came, so a drift between the two sides shows at once instead of as a
silently empty figure. This module imports only the standard library (the desktop loads it without torch).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar, Union

from engine.figures import CacheFigures, EngineFigures

T = TypeVar("T")


class ContractError(ValueError):
    """An engine answer that does not have the shape the contract declares."""


def to_json(body: Any) -> dict[str, Any]:
    """The JSON object of a contract dataclass (field names as keys, nested bodies as objects)."""
    assert dataclasses.is_dataclass(body) and not isinstance(body, type), body
    out = _plain(body)
    assert isinstance(out, dict)
    return out


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: dict[str, Any] = {}
        for f in dataclasses.fields(value):
            item = getattr(value, f.name)
            if f.name == "extra":  # an event's kind-specific fields travel at the top level
                out.update(_plain(item))
            elif not (f.default is None and item is None):  # an optional part left out, not sent as null
                out[f.name] = _plain(item)
        return out
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def parse(cls: type[T], data: Any, where: str = "") -> T:
    """`data` (decoded JSON) as `cls`, or ContractError saying which field differs and how."""
    where = where or cls.__name__
    if not isinstance(data, dict):
        raise ContractError(f"{where}: expected a JSON object, got {_kind(data)}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    open_extra = "extra" in names
    unknown = [k for k in data if k not in names or k == "extra"]
    if unknown and not open_extra:
        raise ContractError(f"{where}: unexpected field {unknown[0]!r}; expected only {', '.join(names)}")
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name == "extra":
            kwargs["extra"] = {k: data[k] for k in unknown}
            continue
        if f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ContractError(f"{where}: missing field {f.name!r}")
            continue
        kwargs[f.name] = _value(hints[f.name], data[f.name], f"{where}.{f.name}")
    return cls(**kwargs)


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _value(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _value(option, value, where)
            except ContractError as exc:
                errors.append(str(exc))
        raise ContractError(errors[0] if len(errors) == 1 else f"{where}: {_kind(value)} matches none of {tp}")
    if tp is Any:
        return value
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ContractError(f"{where}: expected a list, got {_kind(value)}")
        return [_value(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        _, item = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ContractError(f"{where}: expected an object, got {_kind(value)}")
        return {str(k): _value(item, v, f"{where}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return parse(tp, value, where)  # type: ignore[arg-type]
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise ContractError(f"{where}: expected a number, got {_kind(value)}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ContractError(f"{where}: expected a whole number, got {_kind(value)}")
    if tp in (str, bool):
        if isinstance(value, tp):
            return value
        raise ContractError(f"{where}: expected {'text' if tp is str else 'true or false'}, got {_kind(value)}")
    raise AssertionError(f"{where}: the contract has a type it cannot check: {tp}")


# ------------------------------------------------------------------------------------------------ the bodies


@dataclass(frozen=True, slots=True)
class HealthBody:
    """GET /health: 503 with status "loading" while the engine starts, 200 with "ok" once it serves.

    `phase` is the start-up phase (engine/startup_progress.py PHASES; "ready" once ok), `progress` the fraction of
    that phase done where the engine can tell (0..1), `elapsed_s` the seconds the start-up has taken so far."""

    status: str
    phase: str
    elapsed_s: float
    progress: float | None = None


@dataclass(frozen=True, slots=True)
class CacheConfigBody:
    """GET /cache/config; PUT /cache/config answers the same with `changed` (the names whose value changed)."""

    settings: dict[str, Any]  # every live setting by field name, as the engine now runs it
    live: list[str]
    effective_dir: str
    enabled: bool
    changed: list[str] | None = None


@dataclass(frozen=True, slots=True)
class Dropped:
    conversations: int
    bytes: int


@dataclass(frozen=True, slots=True)
class Skipped:
    id: str
    reason: str


@dataclass(frozen=True, slots=True)
class PurgeBody:
    """POST /cache/purge: what was dropped from `tier` and what was skipped (with the reason)."""

    tier: str
    dropped: Dropped
    skipped: list[Skipped] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ConversationRow:
    """One row of GET /cache/conversations (a conversation held in both tiers has a row per tier)."""

    id: str
    tokens: int
    bytes: int
    tier: str
    created: float
    last_used: float
    hits: int
    pending: bool = False
    on_disk: bool = False
    priority: str = "normal"  # "high" | "normal" | "low"
    pinned: bool = False
    name: str = ""  # the first words of its first user message
    client: str = ""  # X-Strata-Client / metadata strata_client, else the User-Agent's first product token
    checkpoints: int = 0  # a hybrid model's recurrent-state checkpoints it can resume from (counted in bytes)
    checkpoint_bytes: int = 0  # what those checkpoints take (part of `bytes`)
    system: str = ""  # the first words of its system prompt (the list shows them on hover)


@dataclass(frozen=True, slots=True)
class ConversationsBody:
    conversations: list[ConversationRow]


@dataclass(frozen=True, slots=True)
class Event:
    """One entry of GET /cache/events; `extra` holds the fields a kind adds (e.g. a refusal's reason)."""

    time: float
    kind: str
    conversation_id: str | None
    tokens: int
    bytes: int
    ms: float
    tier: str
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class EventsBody:
    events: list[Event]


@dataclass(frozen=True, slots=True)
class MetricsBody:
    """GET /metrics as JSON: the engine's figures and the cache's report, each figure declared in engine.figures."""

    engine: EngineFigures
    conversation_cache: CacheFigures


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One completion request explained (GET /cache/requests): how much of its prompt was reused and from where,
    and why the rest was computed.

    `source`: "live" (the slot still held it), "ram", "disk", "remote", "checkpoint" or "none". `reason`: "new_tokens" (only
    tokens nothing held), "diverged" (the prompt left the best candidate at `detail.diverged_at`), "template" (as
    "diverged", where the chat template wrote the history otherwise than at the earlier turn, from token
    `detail.rewritten_at`: past reasoning left out, an answer or an earlier turn rewritten), "evicted" (the
    conversation was dropped: `detail` says when, by what and under which budget), "floor" (its park was refused
    by --conversation-cache-min-free-mib), "refused" (its park was refused otherwise), "n_min", "similarity",
    "cost" (a parked hit was declined; `detail` has the thresholds and both predicted times), "small_gain" (a hit
    offered too few tokens over the live slot), "restore_failed", "window" (a sliding-window model: the prompt
    shares `detail.shared` tokens with a parked conversation, but leaves it before the window its local layers
    keep, so nothing could resume there), "cold" (nothing shared any of it).
    `conversation_id` is the parked conversation it continues, once known (a request served before its
    conversation was first parked gets the id when it is). `ttft_ms`: from the engine taking the request to its
    first token (None until then, or when it produced none). `spec_drafted` / `spec_accepted`: draft tokens
    `--spec prompt-lookup` (or `draft`, `mtp`) had verified for it, and those accepted (0 without speculation).
    `spec_draft_reused`: with `--spec draft` or `mtp`, the request's tokens the draft model (or the next-token
    layer) held already at its first draft (kept in the slot or restored with the conversation; 0 when it re-read
    them all, or for the layer when its part was not restored).
    `past_reasoning`: where the chat format decides which earlier reasoning the prompt carries (harmony), what it did
    with the reasoning the client sent back: `{"rule": "harmony", "dropped": turns, "dropped_tokens": n, "kept":
    turns, "kept_tokens": n}` (dropped reasoning ends the cached prefix there: `reason` "template"); None (left out of
    the JSON) otherwise.
    """

    time: float
    request_id: str
    conversation_id: str | None
    name: str
    client: str
    priority: str
    prompt_tokens: int
    reused_tokens: int
    source: str
    reason: str
    detail: dict[str, Any] = field(default_factory=dict)
    ttft_ms: float | None = None
    spec_drafted: int = 0
    spec_accepted: int = 0
    spec_draft_reused: int = 0
    past_reasoning: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class RequestsBody:
    """GET /cache/requests: the most recent requests, oldest first."""

    requests: list[RequestRecord]
