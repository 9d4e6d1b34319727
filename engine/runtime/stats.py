"""The engine's stats: its counters and rates, and the snapshot the engine thread publishes for any thread to read
without waiting on a step."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from engine.figures import EngineFigures, counter_names
from engine.runtime.explain import RequestLog

log = logging.getLogger("strata.engine")

# While steps run back to back the stats snapshot is refreshed at most this often (and at every request's end).
STATS_INTERVAL_S = 0.1


class EngineStats:
    """Counters and rates (written by the engine thread) and the published snapshot (replaced whole, read by any
    thread). `collect` builds a snapshot's contents: "engine", "conversation_cache", "conversations", "events",
    "slots", "requests"."""

    def __init__(self, collect: Callable[[], dict[str, Any]]) -> None:
        self.collect = collect
        self.started_at = time.time()
        self.counters = dict.fromkeys(counter_names(EngineFigures), 0)  # declared in engine.figures
        self.prefill_rate: float | None = None  # tokens/s, smoothed
        self.decode_rate: float | None = None
        self.requests = RequestLog()  # every request explained (GET /cache/requests)
        self._snapshot: dict[str, Any] = {"published": float("-inf")}

    def snapshot(self) -> dict[str, Any]:
        """The stats the engine thread last published (any thread, never waits on a step). Published at each
        request's end, after each `Engine.call`, and every STATS_INTERVAL_S while steps run, so a step of any
        length never delays a stats reader."""
        snap = self._snapshot
        engine = dataclasses.replace(snap["engine"], uptime_s=time.time() - self.started_at,
                                     stats_age_s=time.monotonic() - snap["published"])
        return {**snap, "engine": engine}

    def publish(self) -> None:
        """Engine thread: a fresh copy of what the stats routes serve (a failure here never stops the loop)."""
        try:
            self._snapshot = {**self.collect(), "published": time.monotonic()}
        except Exception:
            log.exception("publishing the stats snapshot failed; serving the previous one")

    def due(self) -> bool:
        """Whether the snapshot is older than STATS_INTERVAL_S."""
        return time.monotonic() - self._snapshot["published"] >= STATS_INTERVAL_S

    def note_rates(self, n_prefill: int, n_decode: int, dt: float) -> None:
        """Smooth this step's prefill or decode rate into the running ones (a mixed step counts for neither)."""
        if dt <= 0:
            return
        if n_prefill >= 32 and n_decode == 0:
            rate = n_prefill / dt
            self.prefill_rate = rate if self.prefill_rate is None else 0.7 * self.prefill_rate + 0.3 * rate
        elif n_prefill == 0 and n_decode > 0:
            rate = n_decode / dt
            self.decode_rate = rate if self.decode_rate is None else 0.9 * self.decode_rate + 0.1 * rate
