"""Every figure GET /metrics reports, declared once: the engine's and the conversation cache's.

The engine builds these dataclasses, the server sends them (`engine.contract.MetricsBody`, JSON by field name),
the desktop parses them strictly (`engine.contract.parse`: an unknown field or a wrong type is an error) and
the Prometheus renderer reads their fields. Adding a figure is one line here (plus the code that measures it):

    expert_arena_bytes: int = 0                      # a gauge
    prefill_recomputed: int = counter()              # a monotonic total: `strata_<section>_<name>_total`
    prefill_reasons: dict[str, int] = counter(label="reason", metric="prefill_reason")  # one labelled counter
    disk_error: str = condition(label="reason", metric="disk_error")  # a 0/1 gauge, the text as its label

A figure's default is what an engine that does not measure it reports (so an older engine's answer still
parses). Nested dataclasses and dicts of numbers become `<section>_<field>_<key>` gauges; other text fields
become labels of one `strata_<section>_info` gauge; lists and nulls are left out of the Prometheus text.
This module imports only the standard library (the desktop loads it without torch).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


def counter(*, label: str = "", metric: str = "") -> Any:
    """A monotonic total (0 until counted). For a dict of totals, `label` names the Prometheus label its keys
    become and `metric` the family's name (default: `<section>_<field>`)."""
    meta = {"counter": True, "label": label, "metric": metric}
    if label:
        return field(default_factory=dict, metadata=meta)
    return field(default=0, metadata=meta)


def condition(*, label: str, metric: str) -> Any:
    """A text that says what is wrong, empty while all is well. Prometheus gets the gauge `strata_<metric>`: 1 with
    the text as its `label` label, 0 (the label empty) when fine, so an alert needs no text matching."""
    return field(default="", metadata={"condition": label, "metric": metric})


def counter_names(cls: type) -> tuple[str, ...]:
    """The plain (unlabelled) counters a figures class declares, in declaration order."""
    return tuple(
        f.name for f in dataclasses.fields(cls) if f.metadata.get("counter") and not f.metadata.get("label")
    )


@dataclass(frozen=True, slots=True)
class Timing:
    """The last durations of one operation in ms: the latest, the median and p95 of a window, and how many."""

    last: float = 0.0
    p50: float = 0.0
    p95: float = 0.0
    count: int = 0


@dataclass(frozen=True, slots=True)
class EngineFigures:
    """`engine` in GET /metrics."""

    model: str
    state: str
    slots: int = 0
    slots_busy: int = 0
    queued: int = 0
    requests: int = counter()
    prompt_tokens: int = counter()
    cached_tokens: int = counter()
    generated_tokens: int = counter()
    restores_without_reuse: int = counter()  # a hybrid restore that reused nothing (no usable checkpoint)
    spec_drafted_tokens: int = counter()  # --spec: draft tokens verified by the target model
    spec_accepted_tokens: int = counter()  # of those, the ones the target chose too (emitted without a step of their own)
    prefill_tokens_per_s: float | None = None  # None: nothing measured yet
    decode_tokens_per_s: float | None = None
    # --spec prompt-lookup: the acceptance rate below which drafting pauses, measured from the decode steps
    # (engine/runtime/step_costs.py); None with another method or none
    spec_break_even: float | None = None
    uptime_s: float = 0.0
    stats_age_s: float = 0.0  # how old the published snapshot this answer comes from is
    pid: int = 0
    ctx_size: int = 0
    kv_bytes: int = 0
    kv_dtype: str = ""
    devices: list[str] = field(default_factory=list)
    weights_format: str = ""
    int4_kernel: str = ""  # "blocks" (native) or "aten" (PyTorch's) where 4-bit CPU weights are used (engine.model.int4)
    # routed experts resident in host RAM (--moe-experts cpu / --moe-cpu-layers): strata_expert_arena_bytes
    expert_arena_bytes: int = field(default=0, metadata={"metric": "expert_arena_bytes"})
    threads: int = 0  # prefill and mixed steps (--threads)
    decode_threads: int = 0  # steps whose rows are all one token (--decode-threads; 0 there: the count timed now)
    omp_wait_policy: str = ""
    # requests by why their prompt was computed (engine.runtime.explain's reasons)
    prefill_reasons: dict[str, int] = counter(label="reason", metric="prefill_reason")
    # --spec per conversation (the most recent ones, by id once parked): draft tokens verified and accepted; their
    # ratio is the conversation's acceptance rate
    spec_drafted_by_conversation: dict[str, int] = counter(label="conversation",
                                                           metric="spec_drafted_tokens_by_conversation")
    spec_accepted_by_conversation: dict[str, int] = counter(label="conversation",
                                                            metric="spec_accepted_tokens_by_conversation")


@dataclass(frozen=True, slots=True)
class CacheFigures:
    """`conversation_cache` in GET /metrics: the cache's settings, occupancy, counters and timings."""

    enabled: bool
    storage: str
    dir: str = ""
    ram_bytes: int = 0  # the RAM budget
    disk_bytes: int = 0  # the disk budget
    slots: int = 0
    min_free_bytes: int = 0
    block_tokens: int = 0
    bytes_ram: int = 0  # what the RAM tier holds
    bytes_disk: int = 0  # file bytes on disk
    bytes_pending: int = 0  # RAM held by writes not on disk yet
    entries_ram: int = 0
    entries_disk: int = 0
    blocks_ram: int = 0
    blocks_disk: int = 0
    hits: int = counter()
    misses: int = counter()
    tokens_reused: int = counter()
    parks: int = counter()
    restores: int = counter()
    restore_failures: int = counter()
    refusals: dict[str, int] = field(default_factory=dict)  # refused parks by reason
    declined: dict[str, int] = field(default_factory=dict)  # lookups whose hit the policy did not use, by reason
    evictions: int = counter()
    spills: int = counter()
    spill_dropped: int = counter()
    spill_failed: int = counter()
    park_ms: Timing = field(default_factory=Timing)
    restore_ms: Timing = field(default_factory=Timing)
    bytes_parked: int = counter()
    bytes_restored: int = counter()
    bytes_spilled: int = counter()
    restore_bandwidth: dict[str, float] = field(default_factory=dict)  # bytes/s per tier, as the cost model uses
    prefill_tokens_per_s: float | None = None
    # why the disk tier is unusable, else the last write that failed ("ENOSPC (No space left on device): writing
    # conversation ID failed at 2025-05-01T12:00:00Z") until a later write succeeds; empty when fine
    disk_error: str = condition(label="reason", metric="disk_error")
    # the remote tier (--conversation-cache-remote): the store's URL without its password, "" when there is none
    remote: str = ""
    remote_state: str = ""  # "up", "connecting", "down", "full", "read_only", "denied", "error"
    remote_error: str = condition(label="reason", metric="remote_error")  # its last failure, until one succeeds
    remote_bytes: int = 0  # what the store holds, every engine's entries and anything else in it (its used_memory)
    remote_max_bytes: int = 0  # the store's own byte budget (its maxmemory; 0 = none)
    remote_hits: int = counter()  # restores read from the store
    remote_misses: int = counter()  # lookups the store held no block of
    remote_errors: int = counter()  # calls to the store that failed
    remote_refused: int = counter()  # values refused (damaged, truncated, another model's), never restored
    remote_dropped: int = counter()  # parks not written through (the store down, or the write buffer full)
    remote_blocks_put: int = counter()
    remote_bytes_put: int = counter()
    remote_bytes_got: int = counter()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
