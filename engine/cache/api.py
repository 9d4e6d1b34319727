"""The one interface the runtime and the server use: what `Engine` depends on (`ConversationCache` is it).

Threads: the engine thread makes every call except `stats`, `conversations` and `events`, which any thread may,
and `RestoreRead.read`, which a restore reader thread makes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from engine.cache.attrs import ConvAttrs
from engine.cache.explain import LookupReport
from engine.cache.parts import Parts, ReadParts, WriteParts
from engine.cache.restores import RestoreRead
from engine.cache.settings import CacheSettings
from engine.cache.stats import CacheHit, CacheStats, ConversationInfo, ParkResult, PurgeResult, RestoreResult

__all__ = ["CacheAPI", "ReadParts", "WriteParts"]


class CacheAPI(Protocol):
    settings: CacheSettings
    prefill_tokens_per_s: float | None  # measured by the engine; the restore cost model weighs it

    def lookup(self, tokens: Sequence[int], *, live_prefix: int = 0) -> CacheHit | None:
        """The longest parked prefix worth restoring beyond `live_prefix`, or None (read-only)."""
        ...

    def explain_lookup(self, tokens: Sequence[int], *, live_prefix: int = 0) -> tuple[CacheHit | None, LookupReport]:
        """`lookup` and what it saw (the best candidate, the policy's verdict, a loss that would have offered more)."""
        ...

    def record_miss(self) -> None: ...

    def park(
        self, tokens: Sequence[int], read_parts: ReadParts, *, keep: str | None = None, attrs: ConvAttrs = ...,
        checkpoints: Mapping[int, Parts] | None = None,
    ) -> ParkResult:
        """Park a slot's conversation (a hybrid model's: with its recurrent-state `checkpoints` by position);
        a refusal is a `ParkResult` with a reason, never an exception."""
        ...

    def drop(self, conv_id: str) -> PurgeResult:
        """Drop one parked conversation from every tier (KeyError when not parked)."""
        ...

    def set_attrs(self, conv_id: str, *, priority: str | None = None, pinned: bool | None = None) -> str:
        """Change a parked conversation's priority and/or pin; returns its id (KeyError: not parked)."""
        ...

    def restore(self, hit: CacheHit, write_parts: WriteParts) -> RestoreResult:
        """Write the hit's K/V into the slot (a hybrid model's: then its recurrent state, `write_parts(n, state
        parts)`); raises CacheRestoreError before the first write when it cannot."""
        ...

    def begin_restore(self, hit: CacheHit) -> RestoreRead:
        """`restore` split so the read can run on another thread: checks now (CacheRestoreError), then
        `read()` (any thread, never raises), then `deliver(write_parts)` on the engine thread (with
        `persist_use=False`, `persist_use()` afterwards on any thread rewrites a disk entry's manifest)."""
        ...

    def purge(self, tier: str) -> PurgeResult: ...

    def reconfigure(self, settings: CacheSettings) -> list[str]:
        """Apply new settings live; returns the names that changed (nothing changed when it raises)."""
        ...

    def conversations(self) -> list[ConversationInfo]: ...

    def stats(self) -> CacheStats: ...

    def events(self, limit: int = 200) -> list[dict]: ...

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait for pending disk writes; True when all landed and none failed meanwhile."""
        ...

    def close(self, *, spill: bool, deadline_s: float = 30.0) -> None: ...
