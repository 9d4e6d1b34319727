"""The engine's stats: what the engine thread publishes, and the snapshot any thread reads without waiting."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

from engine.figures import EngineFigures
from engine.runtime.control import Control

log = logging.getLogger("strata.engine")

# While steps run back to back the stats snapshot is refreshed at most this often (and at every request's end).
STATS_INTERVAL_S = 0.1


class Stats(Control):
    """The stats snapshot (replaced whole by the engine thread, read by any thread)."""

    def stats_snapshot(self) -> dict[str, Any]:
        """The stats the engine thread last published (any thread, never waits on a step): "engine",
        "conversation_cache", "conversations", "events", "slots", "requests". Published at each request's end, after each
        `call`, and every STATS_INTERVAL_S while steps run, so a step of any length never delays a stats reader."""
        snap = self._stats
        engine = dataclasses.replace(snap["engine"], uptime_s=time.time() - self.started_at,
                                     stats_age_s=time.monotonic() - snap["published"])
        return {**snap, "engine": engine}

    def _publish_stats(self) -> None:
        """Engine thread: a fresh copy of what the stats routes serve (a failure here never stops the loop)."""
        try:
            self._stats = {
                "engine": self.engine_stats(), "conversation_cache": self.cache_figures(),
                "conversations": self.cache_conversations(), "events": self.cache_events(1 << 30),
                "slots": self.slots_info(), "requests": self.requests.snapshot(), "published": time.monotonic(),
            }
        except Exception:
            log.exception("publishing the stats snapshot failed; serving the previous one")

    def engine_stats(self) -> EngineFigures:
        busy = sum(1 for s in self.slots if s.active or s.restoring)
        return EngineFigures(
            model=self.model_name,
            state=self.state,
            slots=self.n_slots,
            slots_busy=busy,
            queued=len(self._waiting),
            **self._counters,
            prefill_tokens_per_s=self._prefill_rate,
            decode_tokens_per_s=self._decode_rate,
            uptime_s=time.time() - self.started_at,
            pid=os.getpid(),
            ctx_size=self.ctx_size,
            kv_bytes=self.kv.nbytes,
            kv_dtype=str(self.kv.layout.dtype).removeprefix("torch."),
            devices=[str(s.device) for s in self.kv.stages],
            weights_format=self.weights_format,
            int4_kernel=self._int4_kernel_name,
            expert_arena_bytes=self.expert_arena_bytes,  # routed experts resident in host RAM (MoE models)
            threads=self.step_threads.compute,
            decode_threads=self.step_threads.decode_choice,
            omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", "default"),  # read once, when torch loaded
            prefill_reasons=dict(self.requests.reasons),
        )
