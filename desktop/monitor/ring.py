"""A fixed-size ring buffer of (time, value) samples for the scrolling plots."""

from __future__ import annotations

import numpy as np


class RingBuffer:
    """Keeps the last `capacity` (x, y) pairs; `data()` returns them oldest first without copying more than once."""

    def __init__(self, capacity: int) -> None:
        assert capacity > 0, "capacity must be positive"
        self.capacity = capacity
        self._x = np.zeros(capacity, dtype=np.float64)
        self._y = np.full(capacity, np.nan, dtype=np.float64)
        self._next = 0
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def append(self, x: float, y: float | None) -> None:
        """Add one sample; None is stored as NaN and drawn as a gap."""
        self._x[self._next] = x
        self._y[self._next] = np.nan if y is None else y
        self._next = (self._next + 1) % self.capacity
        self._count = min(self._count + 1, self.capacity)

    def data(self) -> tuple[np.ndarray, np.ndarray]:
        if self._count < self.capacity:
            return self._x[: self._count].copy(), self._y[: self._count].copy()
        order = np.r_[self._next : self.capacity, 0 : self._next]
        return self._x[order], self._y[order]

    def last(self) -> float | None:
        if not self._count:
            return None
        value = self._y[(self._next - 1) % self.capacity]
        return None if np.isnan(value) else float(value)

    def clear(self) -> None:
        self._next = 0
        self._count = 0
