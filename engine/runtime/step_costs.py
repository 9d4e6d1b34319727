"""What one more row costs a decode step on this machine, measured as the engine runs, and so the acceptance rate
below which a prompt-lookup draft does not pay (engine/runtime/speculation.py `Length`).

A draft of k tokens makes the step compute k more rows; it pays when the tokens it emits per second beat a step
without it. For one drafted token accepted with probability a: (1 + a) / t(2) > 1 / t(1), so a > t(2) / t(1) - 1,
the cost of a row relative to a whole one-row step. That ratio is a property of the machine and the model: ~0.3
for the bundled model's native 4-bit step on 2 cores, more for a mixture of experts whose extra rows route to other
experts. It is measured from the engine's own decode steps (their forward time against their row count, whatever
made the rows: drafts or several slots decoding at once), by a least-squares line t(rows) = base + per_row * (rows - 1)
over all of them with exponentially decaying weights, rather than a time kept per row count: a row count seen
rarely would keep a stale, noisy time (a busy machine moves single steps by ±25 %), while the line is fitted from
every step. Until steps of more than one row count have been seen the fixed rule stands.
"""

from __future__ import annotations

from dataclasses import dataclass

HALF_LIFE_STEPS = 256  # how fast old steps fade: a few seconds of decoding
MIN_WEIGHT = 16.0  # the decayed weight of steps a fit needs
MIN_SPREAD = 0.05  # the decayed variance of their row counts a fit needs (steps of one row count fit no slope)
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

    def note(self, rows: int, seconds: float) -> None:
        """A decode step (no prompt rows) of `rows` rows took `seconds` in the model's forward."""
        assert rows >= 1 and seconds >= 0, (rows, seconds)
        keep = 0.5 ** (1 / HALF_LIFE_STEPS)
        x = rows - 1
        self.weight = self.weight * keep + 1
        self.sum_x = self.sum_x * keep + x
        self.sum_y = self.sum_y * keep + seconds
        self.sum_xx = self.sum_xx * keep + x * x
        self.sum_xy = self.sum_xy * keep + x * seconds

    def line(self) -> tuple[float, float] | None:
        """(base: a one-row step's seconds, per_row: each further row's), or None until the steps seen fit one."""
        if self.weight < MIN_WEIGHT:
            return None
        mean_x, mean_y = self.sum_x / self.weight, self.sum_y / self.weight
        spread = self.sum_xx / self.weight - mean_x * mean_x
        if spread < MIN_SPREAD:
            return None
        per_row = (self.sum_xy / self.weight - mean_x * mean_y) / spread
        return mean_y - per_row * mean_x, per_row

    def break_even(self) -> float:
        """The acceptance rate a drafted token needs for its row to pay: per_row / base, within [LOWEST, HIGHEST];
        the fallback until the steps seen fit a line."""
        fit = self.line()
        if fit is None or fit[0] <= 0:
            return self.fallback
        base, per_row = fit
        return min(HIGHEST, max(LOWEST, per_row / base))
