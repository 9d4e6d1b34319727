"""Reading the engine's reports tolerantly: a missing key shows as a dash, never as an exception."""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any


def dig(data: Any, *keys: str, default: Any = None) -> Any:
    """data[k1][k2]... or `default` when any level is missing or of the wrong type."""
    for key in keys:
        if not isinstance(data, dict) or key not in data:
            return default
        data = data[key]
    return default if data is None else data


def number(data: Any, *keys: str) -> float | None:
    value = dig(data, *keys)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def timestamp(value: Any) -> float | None:
    """Epoch seconds from a number (s or ms) or an ISO-8601 string."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value) / 1000 if value > 1e11 else float(value)
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return None
    return None


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


def since(value: Any, now: float | None = None) -> float | None:
    t = timestamp(value)
    return None if t is None else (now or time.time()) - t


def format_count(n: float | None) -> str:
    if n is None:
        return "–"
    return f"{n:,.0f}".replace(",", "\u202f")


def format_ms(ms: float | None) -> str:
    if ms is None:
        return "–"
    return f"{ms:.1f} ms" if ms < 100 else f"{ms:.0f} ms"


def budget(cache: Any, key: str) -> float | None:
    """A budget from the cache report (ram_bytes, disk_bytes, slots, min_free_bytes), as engine/cache/stats.py has it."""
    return number(cache, key)


def total(value: Any) -> float | None:
    """A counter reported as a number or as {reason: count}."""
    if isinstance(value, dict):
        counts = [v for v in value.values() if isinstance(v, int | float) and not isinstance(v, bool)]
        return float(sum(counts))
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)
