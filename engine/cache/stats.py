"""Plain data the cache reports: results of its calls, per-conversation rows, counters and timings."""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class CacheHit:
    """A reusable prefix: the first `n_tokens` tokens of the request can come from `conversation_id`."""

    conversation_id: str
    n_tokens: int
    tier: str  # "ram" | "disk"
    nbytes: int  # K/V bytes written into the slot on restore
    identity_key: str = ""

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
    checkpoints: int = 0  # a hybrid model's recurrent-state checkpoints (its own and those in its blocks)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True)
class Timing:
    last: float = 0.0
    p50: float = 0.0
    p95: float = 0.0
    count: int = 0


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


@dataclass(slots=True)
class CacheStats:
    """A snapshot of the cache for /metrics; `to_dict()` is its JSON form."""

    enabled: bool
    storage: str
    dir: str
    ram_bytes: int
    disk_bytes: int
    slots: int
    min_free_bytes: int
    block_tokens: int
    bytes_ram: int = 0
    bytes_disk: int = 0
    bytes_pending: int = 0
    entries_ram: int = 0
    entries_disk: int = 0
    blocks_ram: int = 0
    blocks_disk: int = 0
    hits: int = 0
    misses: int = 0
    tokens_reused: int = 0
    parks: int = 0
    restores: int = 0
    restore_failures: int = 0
    refusals: dict[str, int] = field(default_factory=dict)
    declined: dict[str, int] = field(default_factory=dict)  # lookups whose hit the policy did not use
    evictions: int = 0
    spills: int = 0
    spill_dropped: int = 0
    spill_failed: int = 0
    park_ms: Timing = field(default_factory=Timing)
    restore_ms: Timing = field(default_factory=Timing)
    bytes_parked: int = 0
    bytes_restored: int = 0
    bytes_spilled: int = 0
    restore_bandwidth: dict[str, float] = field(
        default_factory=dict
    )  # bytes/s per tier, as the cost model uses
    prefill_tokens_per_s: float | None = None
    disk_error: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
