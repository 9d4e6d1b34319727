"""A parked conversation's attributes, set by the requests that build it: priority, pin, name, client and the
first words of its system prompt.

A request may leave priority or pin unset (None): a conversation that continues a parked line then keeps that
line's values (set by an earlier request or by `PATCH /cache/conversations/{id}`), a new one gets the defaults.
Which conversation gives way to which is engine.cache.policy (`precedence`, `eviction_order`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

PRIORITIES = ("low", "normal", "high")  # lowest first: the order in which budgets take them
DEFAULT_PRIORITY = "normal"
MAX_NAME_CHARS = 48
MAX_CLIENT_CHARS = 64


class HasAttrs(Protocol):
    priority: str
    pinned: bool
    name: str
    client: str
    system: str
    last_used: float


@dataclass(frozen=True, slots=True)
class ConvAttrs:
    """What one request says about its conversation; None = keep what the parked line has (else the default)."""

    priority: str | None = None
    pinned: bool | None = None
    name: str = ""
    client: str = ""
    system: str = ""  # the first words of its system prompt (shown on hover beside the name)

    def __post_init__(self) -> None:
        assert self.priority is None or self.priority in PRIORITIES, self.priority
        assert len(self.name) <= MAX_NAME_CHARS and len(self.system) <= MAX_NAME_CHARS, (self.name, self.system)
        assert len(self.client) <= MAX_CLIENT_CHARS, self.client

    def resolve(self, line: Sequence[HasAttrs]) -> tuple[str, bool, str, str, str]:
        """(priority, pinned, name, client, system) of an entry that continues `line` (the entries it supersedes).

        The line's most recent entry speaks for it; the name and system words stay those the line started with."""
        latest = max(line, key=lambda c: c.last_used) if line else None
        priority = self.priority or (latest.priority if latest else DEFAULT_PRIORITY)
        pinned = self.pinned if self.pinned is not None else bool(latest and latest.pinned)
        name = (latest.name if latest and latest.name else "") or self.name
        client = self.client or (latest.client if latest else "")
        system = (latest.system if latest and latest.name else "") or self.system
        return priority, pinned, name, client, system


NO_ATTRS = ConvAttrs()
