"""How the Monitor writes the engine's figures: counts, sizes, durations and ages in words, "–" for none.

The figures themselves arrive typed (engine/contract.py, engine/figures.py, parsed strictly in desktop/client.py);
only a request's `detail` is an open object whose keys depend on its reason, read with `number`.
"""

from __future__ import annotations

from typing import Any


def number(data: dict[str, Any], key: str) -> float | None:
    """An open object's (a request's `detail`) number under `key`, or None where it has none."""
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def format_age(seconds: float | None) -> str:
    """12 -> "12 s", 300 -> "5 min", 7200 -> "2.0 h"."""
    if seconds is None:
        return "–"
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def format_count(n: float | None) -> str:
    if n is None:
        return "–"
    return f"{n:,.0f}".replace(",", "\u202f")


def format_ms(ms: float | None) -> str:
    if ms is None:
        return "–"
    return f"{ms:.1f} ms" if ms < 100 else f"{ms:.0f} ms"


def format_drafts(drafted: int, accepted: int) -> str:
    """Speculative decoding's figures: "120 of 200 accepted (60%)"; "–" while nothing was drafted."""
    if not drafted:
        return "–"
    return f"{format_count(accepted)} of {format_count(drafted)} accepted ({100 * accepted / drafted:.0f}%)"
