"""Plain data the cache reports: results of its calls, per-conversation rows, counters and timings."""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field

from engine.figures import CacheFigures, Timing

# The cache's report for /metrics: its figures are declared once, in engine.figures.
CacheStats = CacheFigures


@dataclass(frozen=True, slots=True)
class CacheHit:
    """A reusable prefix: the first `n_tokens` tokens of the request can come from `conversation_id`."""

    conversation_id: str
    n_tokens: int
    tier: str  # "ram" | "disk"
    nbytes: int  # K/V bytes written into the slot on restore
    identity_key: str = ""
    priority: str = "normal"  # the parked conversation's attributes, which the slot then holds
    pinned: bool = False
    tokens_key: str = ""  # identity.tokens_key of the request's first n_tokens: the restore checks it holds them

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True)
class ParkResult:
    parked: bool
    conversation_id: str | None = None
    reason: str = ""  # why it was refused; empty when parked
    tier: str = ""
    n_tokens: int = 0
    new_bytes: int = 0  # bytes captured by this park (incremental re-parks capture only new blocks + tail)
    ms: float = 0.0
    evicted: int = 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True)
class RestoreResult:
    n_tokens: int
    nbytes: int
    ms: float
    tier: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True)
class PurgeResult:
    dropped: int
    bytes: int
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (conversation id, reason)
    tier: str = ""

    def to_dict(self) -> dict:
        return {
            "tier": self.tier,
            "dropped": {"conversations": self.dropped, "bytes": self.bytes},
            "skipped": [{"id": cid, "reason": reason} for cid, reason in self.skipped],
        }


@dataclass(frozen=True, slots=True)
class ConversationInfo:
    id: str
    tokens: int
    bytes: int
    tier: str
    created: float
    last_used: float
    hits: int
    pending: bool = False  # tiered: evicted from RAM, its disk write not finished yet
    # its files are published: it survives a crash or a kill. False for RAM-tier conversations (in tiered mode
    # they reach the disk when RAM evicts them or at a clean shutdown) and for pending disk writes.
    on_disk: bool = False
    priority: str = "normal"
    pinned: bool = False
    name: str = ""  # the first words of its first user message
    client: str = ""  # who sent it: X-Strata-Client / strata_client, else the User-Agent's first product
    checkpoints: int = 0  # a hybrid model's recurrent-state checkpoints (its own and those in its blocks)
    checkpoint_bytes: int = 0  # their bytes (checkpoints x the identity's state bytes; part of `bytes`)
    system: str = ""  # the first words of its system prompt

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class TimingWindow:
    """The last `size` durations in ms, summarised as last/p50/p95."""

    def __init__(self, size: int = 256) -> None:
        self._values: deque[float] = deque(maxlen=size)
        self.count = 0

    def add(self, ms: float) -> None:
        self._values.append(ms)
        self.count += 1

    def summary(self) -> Timing:
        if not self._values:
            return Timing()
        ordered = sorted(self._values)

        def pct(p: float) -> float:
            return ordered[min(len(ordered) - 1, int(round(p * (len(ordered) - 1))))]

        return Timing(last=self._values[-1], p50=pct(0.5), p95=pct(0.95), count=self.count)
