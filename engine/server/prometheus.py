"""GET /metrics in Prometheus text format, read from the typed figures (engine.figures) the JSON body carries.

A numeric field `engine.prompt_tokens` becomes `strata_engine_prompt_tokens`; nested figures and dicts of numbers
join their names with `_` (`conversation_cache.park_ms.p95` -> `strata_conversation_cache_park_ms_p95`).
Booleans are 0/1. A field declared with `counter()` is a counter (exposed with `_total`); a dict declared with
`counter(label=...)` is one labelled counter family; every other number is a gauge. A text declared with
`condition()` is its own 0/1 gauge with the text as a label (`strata_disk_error{reason="..."} 1`); other text
fields become labels of one `strata_<section>_info` gauge whose value is 1. Lists and nulls are left out.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from engine.contract import MetricsBody

PREFIX = "strata"
# What `render_prometheus` writes: the text format 0.0.4, which every Prometheus reads. prometheus_client's
# CONTENT_TYPE_LATEST now names 1.0.0, which older scrapers do not know; /openapi.json declares this type too.
MEDIA_TYPE = "text/plain; version=0.0.4"
CONTENT_TYPE = MEDIA_TYPE + "; charset=utf-8"
_NOT_NAME = re.compile(r"[^a-zA-Z0-9_]")


def _name(parts: list[str]) -> str:
    return _NOT_NAME.sub("_", "_".join([PREFIX, *parts]))


def _leaves(value: Any, path: list[str]) -> Iterator[tuple[list[str], Any, Mapping[str, Any]]]:
    """(path, value, field metadata) of every leaf of a figures dataclass; dicts and nested figures recurse."""
    for f in dataclasses.fields(value):
        item = getattr(value, f.name)
        if dataclasses.is_dataclass(item):
            yield from _leaves(item, [*path, f.name])
        elif isinstance(item, Mapping) and not f.metadata.get("label"):
            for key, v in item.items():
                yield [*path, f.name, str(key)], v, {}
        else:
            yield [*path, f.name], item, f.metadata


class _FiguresCollector:
    """Renders the /metrics sections; one instance per scrape, registered in a throwaway registry."""

    def __init__(self, body: MetricsBody) -> None:
        self._body = body

    def collect(self) -> Iterator[Metric]:
        for section in (f.name for f in dataclasses.fields(self._body)):
            labels: dict[str, str] = {}
            for path, value, meta in _leaves(getattr(self._body, section), [section]):
                doc = f"{'.'.join(path)} in the /metrics JSON"
                if meta.get("label"):
                    name = _name([meta["metric"]]) if meta.get("metric") else _name(path)
                    family = CounterMetricFamily(name, doc, labels=[meta["label"]])
                    for key in sorted(value):
                        family.add_metric([str(key)], value[key])
                    yield family
                    continue
                if meta.get("condition"):
                    gauge = GaugeMetricFamily(_name([meta["metric"]]), doc + " (1 while it is not empty)",
                                              labels=[meta["condition"]])
                    gauge.add_metric([value], 1 if value else 0)
                    yield gauge
                    continue
                if isinstance(value, str):
                    labels[_NOT_NAME.sub("_", "_".join(path[1:]))] = value
                    continue
                if isinstance(value, bool):
                    value = int(value)
                if not isinstance(value, int | float):
                    continue
                kind = CounterMetricFamily if meta.get("counter") else GaugeMetricFamily
                yield kind(_name([meta["metric"]]) if meta.get("metric") else _name(path), doc, value=value)
            if labels:
                info = GaugeMetricFamily(_name([section, "info"]), f"text fields of {section} in the /metrics JSON",
                                         labels=sorted(labels))
                info.add_metric([labels[k] for k in sorted(labels)], 1)
                yield info


def render_prometheus(body: MetricsBody) -> bytes:
    """Prometheus text exposition (format 0.0.4) of the /metrics body."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_FiguresCollector(body))
    return generate_latest(registry)
