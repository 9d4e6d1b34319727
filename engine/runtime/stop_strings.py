"""Holds back generated text that might be the start of a stop string, and cuts the text at a stop string."""

from __future__ import annotations


class StopStringFilter:
    """Feed text deltas; get back the text that is safe to send and whether a stop string was reached."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._pending = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended generation

    def push(self, text: str) -> str:
        """Add generated text; returns what can be sent now (nothing after a stop string is ever returned)."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        self._pending += text
        found = [(i, s) for s in self.stops if (i := self._pending.find(s)) >= 0]
        if found:
            cut, self.matched = min(found, key=lambda f: f[0])
            self.stopped = True
            out, self._pending = self._pending[:cut], ""
            return out
        hold = self._longest_partial_stop()
        out = self._pending[: len(self._pending) - hold]
        self._pending = self._pending[len(out) :]
        return out

    def flush(self) -> str:
        """The text held back, at the end of generation."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out

    def _longest_partial_stop(self) -> int:
        """Length of the longest suffix of the pending text that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self._pending)), 0, -1):
                if self._pending.endswith(stop[:n]):
                    best = max(best, n)
                    break
        return best
