"""Start-up progress: the phase the engine is in while it loads, for GET /health and the start-up log line.

One `StartupProgress` per server: the loader thread moves it through `PHASES` in order (`begin`), reports a
fraction where the phase can tell (`advance`: layers built so far), and the /health route reads it from the
event loop's thread (`health`). The same record gives the `start-up phases: ...` log line (`summary`), so the
log and /health never disagree. Code deep in the loader reports through `report` (a context variable holds the
progress of the load running in that thread), so no loader signature carries it.

This module imports only the standard library and the contract: every layer of the engine may use it.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections.abc import Callable, Iterator

from engine.contract import HealthBody

PHASES = ("reading model file", "loading weights", "allocating K/V", "building cache index", "warming up")
READY_PHASE = "ready"

_current: contextvars.ContextVar[StartupProgress | None] = contextvars.ContextVar("strata_startup", default=None)


class StartupProgress:
    """Where the start-up is: a phase of `PHASES` (in order), its fraction done where known, the seconds spent."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._started = clock()
        self._phase = PHASES[0]
        self._phase_started = self._started
        self._fraction: float | None = None
        self._seconds: dict[str, float] = {}  # finished phases, in order
        self._finished_after: float | None = None

    def begin(self, phase: str) -> None:
        """Enter `phase`; the phases only move forward (a phase may be skipped, never revisited)."""
        assert phase in PHASES, f"unknown start-up phase {phase!r}; expected one of {PHASES}"
        with self._lock:
            assert self._finished_after is None, "the start-up already finished"
            if phase == self._phase:
                return
            assert PHASES.index(phase) > PHASES.index(self._phase), f"start-up phase {phase!r} after {self._phase!r}"
            self._close_phase()
            self._phase, self._fraction = phase, None

    def advance(self, done: int, total: int) -> None:
        """`done` of `total` steps of the current phase are finished."""
        assert 0 <= done <= total and total > 0, (done, total)
        with self._lock:
            self._fraction = done / total

    def finish(self) -> None:
        """The engine is built and serving."""
        with self._lock:
            if self._finished_after is None:
                self._close_phase()
                self._finished_after = self._clock() - self._started

    def _close_phase(self) -> None:
        now = self._clock()
        self._seconds[self._phase] = self._seconds.get(self._phase, 0.0) + now - self._phase_started
        self._phase_started = now

    def health(self, ready: bool) -> HealthBody:
        """The body of GET /health: `ready` is whether the engine serves (the route's own test of that)."""
        with self._lock:
            if ready:
                elapsed = self._finished_after if self._finished_after is not None else self._clock() - self._started
                return HealthBody(status="ok", phase=READY_PHASE, progress=1.0, elapsed_s=round(elapsed, 3))
            return HealthBody(status="loading", phase=self._phase, progress=self._fraction,
                              elapsed_s=round(self._clock() - self._started, 3))

    def summary(self) -> str:
        """'reading model file 2.90 s, loading weights 1.24 s, ...': the finished phases and their seconds."""
        with self._lock:
            return ", ".join(f"{phase} {seconds:.2f} s" for phase, seconds in self._seconds.items())

    @contextlib.contextmanager
    def reporting(self) -> Iterator[StartupProgress]:
        """Within the block, `report` in this thread (or context) reaches this progress."""
        token = _current.set(self)
        try:
            yield self
        finally:
            _current.reset(token)


def report(done: int, total: int) -> None:
    """`done` of `total` steps of the current phase are finished; a no-op outside `StartupProgress.reporting`."""
    progress = _current.get()
    if progress is not None:
        progress.advance(done, total)
