"""What the cache has done, for /metrics and /cache/events: counters, refusals, declines, events, timings,
the measured restore bandwidth per tier, the id redirects of superseded conversations, and what was lost.

One `Journal` per cache, shared by its tiers; every method is called with the cache's lock held.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque

from engine.cache.explain import Losses
from engine.cache.stats import TimingWindow
from engine.figures import CacheFigures, counter_names

COUNTERS = counter_names(CacheFigures)  # every total the cache reports, declared in engine.figures
MAX_REDIRECTS = 4096


class Journal:
    def __init__(self) -> None:
        self.counts = dict.fromkeys(COUNTERS, 0)
        self.refusals: dict[str, int] = {}
        self.declined: dict[str, int] = {}
        self.events: deque[dict] = deque(maxlen=1000)
        self.park_ms = TimingWindow()
        self.restore_ms = TimingWindow()
        # bytes/s; replaced by measurements after restores (remote: a 1 GbE link until measured)
        self.bandwidth = {"ram": 4e9, "disk": 1e9, "remote": 1.1e8}
        self.redirects: OrderedDict[str, str] = OrderedDict()
        self.losses = Losses()  # what left the cache, so a later lookup can say why it is missing

    def count(self, name: str, n: int = 1) -> None:
        assert name in self.counts, name
        self.counts[name] += n

    def refused(self, reason: str) -> None:
        self.refusals[reason] = self.refusals.get(reason, 0) + 1

    def declined_hit(self, reason: str) -> None:
        self.declined[reason] = self.declined.get(reason, 0) + 1

    def event(self, kind: str, conv_id: str | None, tokens: int, nbytes: int, ms: float, tier: str, **extra):
        self.events.append(
            {
                "time": time.time(),
                "kind": kind,
                "conversation_id": conv_id,
                "tokens": tokens,
                "bytes": nbytes,
                "ms": round(ms, 3),
                "tier": tier,
                **extra,
            }
        )

    def restored(self, tier: str, read_bytes: int, ms: float) -> None:
        """Record a restore's time and fold its read rate into the tier's bandwidth (what the cost model uses)."""
        self.restore_ms.add(ms)
        if ms > 0:
            measured = read_bytes / (ms / 1000)
            old = self.bandwidth[tier]
            self.bandwidth[tier] = measured if self.restore_ms.count == 1 else 0.7 * old + 0.3 * measured

    def redirect(self, old: str, new: str) -> None:
        """`old` was superseded by `new`: a hit naming `old` restores `new`."""
        self.redirects[old] = new
        while len(self.redirects) > MAX_REDIRECTS:
            self.redirects.popitem(last=False)
