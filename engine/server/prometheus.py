"""GET /metrics in Prometheus text format, derived mechanically from the JSON body so the two never disagree.

A numeric JSON leaf at path `engine.prompt_tokens` becomes `strata_engine_prompt_tokens`; nested objects join
their keys with `_` (`conversation_cache.park_ms.p95` -> `strata_conversation_cache_park_ms_p95`). Booleans are
0/1. Leaves named in COUNTERS are counters (exposed with `_total`), every other number is a gauge. String leaves
become labels of one `strata_<section>_info` gauge whose value is 1. Lists and nulls are left out.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

PREFIX = "strata"
# Monotonic totals in the engine's and the conversation cache's stats.
COUNTERS = frozenset({
    "requests", "prompt_tokens", "cached_tokens", "generated_tokens",
    "hits", "misses", "tokens_reused", "parks", "restores", "restore_failures", "evictions", "spills",
    "spill_dropped", "spill_failed", "bytes_parked", "bytes_restored", "bytes_spilled", "restores_without_reuse",
})
_NOT_NAME = re.compile(r"[^a-zA-Z0-9_]")


def _name(parts: list[str]) -> str:
    return _NOT_NAME.sub("_", "_".join([PREFIX, *parts]))


def _walk(obj: Mapping[str, Any], path: list[str]) -> Iterator[tuple[list[str], Any]]:
    for key, value in obj.items():
        if isinstance(value, Mapping):
            yield from _walk(value, [*path, str(key)])
        else:
            yield [*path, str(key)], value


class _StatsCollector:
    """Renders the /metrics JSON sections; one instance per scrape, registered in a throwaway registry."""

    def __init__(self, sections: Mapping[str, Mapping[str, Any]]) -> None:
        self._sections = sections

    def collect(self) -> Iterator[Metric]:
        for section, stats in self._sections.items():
            labels: dict[str, str] = {}
            for path, value in _walk(stats, [section]):
                if isinstance(value, str):
                    labels[_NOT_NAME.sub("_", "_".join(path[1:]))] = value
                    continue
                if isinstance(value, bool):
                    value = int(value)
                if not isinstance(value, int | float):
                    continue
                name = _name(path)
                doc = f"{'.'.join(path)} in the /metrics JSON"
                if path[-1] in COUNTERS:
                    yield CounterMetricFamily(name, doc, value=value)
                else:
                    yield GaugeMetricFamily(name, doc, value=value)
            if labels:
                info = GaugeMetricFamily(_name([section, "info"]), f"text fields of {section} in the /metrics JSON",
                                         labels=sorted(labels))
                info.add_metric([labels[k] for k in sorted(labels)], 1)
                yield info


def render_prometheus(sections: Mapping[str, Mapping[str, Any]]) -> bytes:
    """Prometheus text exposition (format 0.0.4) of {"engine": {...}, "conversation_cache": {...}}."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StatsCollector(sections))
    return generate_latest(registry)
