"""What one more row costs a decode step on this machine, measured as the engine runs, and so the acceptance rate
below which a prompt-lookup draft does not pay (engine/runtime/speculation.py `Length`).

A draft of k tokens makes the step compute k more rows; it pays when the tokens it emits per second beat a step
without it. For one drafted token accepted with probability a, with N slots decoding in the step (N rows without
it): (N + a) / (t(N) + per_row) > N / t(N), so a > N per_row / t(N), the cost of a row relative to a whole step's
share of each slot (per_row / t(1) for one slot). That ratio is a property of the machine and the model: ~0.3
for the bundled model's native 4-bit step on 2 cores, more for a mixture of experts whose extra rows route to other
experts. It is measured from the engine's own decode steps (their forward time against their row count, whatever
made the rows: drafts or several slots decoding at once), by a least-squares line t(rows) = base + per_row * (rows - 1)
over all of them with exponentially decaying weights, rather than a time kept per row count: a row count seen
rarely would keep a stale, noisy time (a busy machine moves single steps by ±25 %), while the line is fitted from
every step. Until at least two row counts have each been seen in several recent steps the fixed rule stands (one
step of another row count, ±25 %, would decide the slope alone).
"""

from __future__ import annotations

from dataclasses import dataclass, field

HALF_LIFE_STEPS = 256  # how fast old steps fade: a few seconds of decoding
MIN_WEIGHT = 16.0  # the decayed weight of steps a fit needs
MIN_SPREAD = 0.05  # the decayed variance of their row counts a fit needs (steps of one row count fit no slope)
MIN_PER_COUNT = 4.0  # the decayed weight two row counts each need: no single step of a row count decides the slope
# The break-even is kept within these: a measurement never says drafting is free, nor that nothing could pay.
LOWEST, HIGHEST = 0.05, 0.95


@dataclass(slots=True)
class StepCosts:
    """A decaying least-squares fit of decode steps' forward seconds against their rows minus one (engine thread
    only)."""

    fallback: float
    weight: float = 0.0
    sum_x: float = 0.0
    sum_y: float = 0.0
    sum_xx: float = 0.0
    sum_xy: float = 0.0
    by_rows: dict[int, float] = field(default_factory=dict)  # decayed weight of the steps of each row count
    slots: int = 1  # the slots decoding in the latest step (its rows without drafts)

    def note(self, rows: int, seconds: float, slots: int = 1) -> None:
        """A decode step (no prompt rows) of `rows` rows, `slots` of them one per decoding slot and the rest drafts,
        took `seconds` in the model's forward."""
        assert 1 <= slots <= rows and seconds >= 0, (rows, slots, seconds)
        keep = 0.5 ** (1 / HALF_LIFE_STEPS)
        for count in list(self.by_rows):
            self.by_rows[count] *= keep
            if self.by_rows[count] < 0.01:
                del self.by_rows[count]  # a row count not seen for a long while
        self.by_rows[rows] = self.by_rows.get(rows, 0.0) + 1
        self.slots = slots
        x = rows - 1
        self.weight = self.weight * keep + 1
        self.sum_x = self.sum_x * keep + x
        self.sum_y = self.sum_y * keep + seconds
        self.sum_xx = self.sum_xx * keep + x * x
        self.sum_xy = self.sum_xy * keep + x * seconds

    def line(self) -> tuple[float, float] | None:
        """(base: a one-row step's seconds, per_row: each further row's), or None until the steps seen fit one."""
        if self.weight < MIN_WEIGHT or sum(w >= MIN_PER_COUNT for w in self.by_rows.values()) < 2:
            return None
        mean_x, mean_y = self.sum_x / self.weight, self.sum_y / self.weight
        spread = self.sum_xx / self.weight - mean_x * mean_x
        if spread < MIN_SPREAD:
            return None
        per_row = (self.sum_xy / self.weight - mean_x * mean_y) / spread
        return mean_y - per_row * mean_x, per_row

    def break_even(self) -> float:
        """The acceptance rate a drafted token needs for its row to pay, with the slots decoding now:
        slots * per_row / t(slots), within [LOWEST, HIGHEST]; the fallback until the steps seen fit a line."""
        fit = self.line()
        if fit is None or fit[0] <= 0:
            return self.fallback
        base, per_row = fit
        step = base + (self.slots - 1) * per_row
        return min(HIGHEST, max(LOWEST, self.slots * per_row / step))
