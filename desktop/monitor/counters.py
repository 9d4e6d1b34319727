"""Counters the engine reports: hit rate, tokens saved, park/restore figures, bytes per tier against each budget."""

from __future__ import annotations

from typing import Any

from PySide6.QtWidgets import QFormLayout, QGridLayout, QGroupBox, QLabel, QProgressBar, QVBoxLayout, QWidget

from desktop.monitor.report import budget, dig, format_age, format_count, format_ms, number, total
from desktop.settings import UNIQUE_BYTES, format_bytes

MIB = 1 << 20


class BudgetBar(QProgressBar):
    """Used bytes against a budget, as a bar with the figures written on it."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setRange(0, 1000)
        self.setTextVisible(True)
        self.set_usage(None, None)

    def set_usage(self, used: float | None, budget: float | None, unit: str = "bytes") -> None:
        fmt = format_bytes if unit == "bytes" else format_count
        if used is None:
            self.setValue(0)
            self.setFormat("–")
            return
        if budget:
            self.setValue(int(min(1.0, used / budget) * 1000))
            self.setFormat(f"{fmt(used)} of {fmt(budget)} ({100 * used / budget:.0f}%)")
        else:
            self.setValue(0)
            self.setFormat(f"{fmt(used)} (no budget)")


def _value_label() -> QLabel:
    label = QLabel("–")
    label.setObjectName("value")
    # Long figures ("Runs as", "Park time") wrap: unwrapped, their width squeezed the plots beside them at 800 px.
    label.setWordWrap(True)
    return label


class CountersPanel(QWidget):
    """Figures from /metrics, shown as reported."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.labels: dict[str, QLabel] = {}
        self._cache: dict[str, Any] = {}
        self._rates: dict[str, float] = {}
        self._parked: int | None = None
        self._slots_budget: float | None = None
        engine_box = QGroupBox("Engine")
        engine_form = QFormLayout(engine_box)
        for key, text in (("model", "Model"), ("compute", "Runs as"), ("state", "State"), ("slots", "Slots busy"),
                          ("queued", "Queued"), ("requests", "Requests"), ("speed", "Prefill / decode"),
                          ("uptime", "Uptime")):
            self.labels[key] = _value_label()
            engine_form.addRow(text, self.labels[key])

        cache_box = QGroupBox("Conversation cache")
        cache_form = QFormLayout(cache_box)
        for key, text in (("storage", "Storage"), ("hit_rate", "Hit rate"), ("tokens_saved", "Tokens saved"),
                          ("parks", "Parks / restores"), ("evictions", "Evictions / refusals"),
                          ("park_ms", "Park time"), ("restore_ms", "Restore time"), ("remote", "Remote store")):
            self.labels[key] = _value_label()
            cache_form.addRow(text, self.labels[key])

        budget_box = QGroupBox("Stored against budgets")
        grid = QGridLayout(budget_box)
        self.ram_bar, self.disk_bar, self.slots_bar = BudgetBar(), BudgetBar(), BudgetBar()
        self.remote_bar = BudgetBar()  # the shared store: what it holds (every engine's) against its maxmemory
        for row, (text, bar) in enumerate((("RAM", self.ram_bar), ("Disk", self.disk_bar),
                                           ("Conversations", self.slots_bar), ("Remote store", self.remote_bar))):
            grid.addWidget(QLabel(text), row, 0)
            grid.addWidget(bar, row, 1)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(engine_box)
        layout.addWidget(cache_box)
        layout.addWidget(budget_box)
        layout.addStretch(1)

    def set_events(self, events: list[dict[str, Any]]) -> None:
        """Recent park/restore events: the newest of each kind gives the transfer rate shown beside the times."""
        self._rates = {}
        for ev in events:
            kind, ms, size = ev.get("kind"), number(ev, "ms"), number(ev, "bytes")
            if kind in ("park", "restore") and ms and size:  # an incremental re-park may move no bytes
                self._rates[kind] = size / MIB / (ms / 1e3)  # MiB/s of the newest event (the list is oldest first)
        self._show_timings()

    def _show_timings(self) -> None:
        self.labels["park_ms"].setText(_timing(self._cache, "park_ms", self._rates.get("park")))
        self.labels["restore_ms"].setText(_timing(self._cache, "restore_ms", self._rates.get("restore")))

    def set_metrics(self, m: dict[str, Any]) -> None:
        e = dig(m, "engine", default={})
        c = dig(m, "conversation_cache", default={})
        lb = self.labels
        lb["model"].setText(str(dig(e, "model", default="–")))
        lb["model"].setToolTip(str(dig(e, "model", default="")))
        lb["compute"].setText(runs_as(e))
        lb["state"].setText(str(dig(e, "state", default="–")))
        busy, slots = number(e, "slots_busy"), number(e, "slots")
        lb["slots"].setText(f"{format_count(busy)} of {format_count(slots)}")
        lb["queued"].setText(format_count(number(e, "queued")))
        lb["requests"].setText(format_count(number(e, "requests")))
        pf, dc = number(e, "prefill_tokens_per_s"), number(e, "decode_tokens_per_s")
        lb["speed"].setText(f"{_rate(pf)} / {_rate(dc)} tokens/s")
        lb["uptime"].setText(format_age(number(e, "uptime_s")))

        if not c or dig(c, "enabled", default=True) is False:
            lb["storage"].setText("off" if c else "–")
        else:
            where = dig(c, "dir", default="")
            mode = str(dig(c, "storage", default="–"))
            lb["storage"].setText(mode)
            lb["storage"].setToolTip(f"Folder: {where}" if where else "")
        hits, misses = number(c, "hits"), number(c, "misses")
        rate = number(c, "hit_rate")
        if rate is None and hits is not None and misses is not None and hits + misses > 0:
            rate = hits / (hits + misses)
        lb["hit_rate"].setText(("–" if rate is None else f"{100 * rate:.0f}%")
                               + f"  ({format_count(hits)} hits, {format_count(misses)} misses)")
        saved = number(c, "tokens_reused")
        if saved is None:
            saved = number(e, "cached_tokens")
        lb["tokens_saved"].setText(format_count(saved))
        lb["parks"].setText(f"{format_count(number(c, 'parks'))} / {format_count(number(c, 'restores'))}")
        refusals = dig(c, "refusals")
        lb["evictions"].setText(f"{format_count(number(c, 'evictions'))} / {format_count(total(refusals))}")
        lb["evictions"].setToolTip(
            "\n".join(f"{k}: {v}" for k, v in refusals.items()) if isinstance(refusals, dict) and refusals else "")
        self._cache = c
        self._show_timings()

        uses_disk = dig(c, "storage") in ("disk", "tiered")
        self.ram_bar.set_usage(number(c, "bytes_ram"), budget(c, "ram_bytes"))
        self.disk_bar.set_usage(number(c, "bytes_disk") if uses_disk or number(c, "bytes_disk") else None,
                                budget(c, "disk_bytes"))
        if not uses_disk and not number(c, "bytes_disk") and c:
            self.disk_bar.setFormat(f"not used in {dig(c, 'storage', default='this')} mode")
        error = str(dig(c, "disk_error", default=""))
        if error:
            self.disk_bar.setFormat("error: " + error)
        self.disk_bar.setToolTip(error or UNIQUE_BYTES)
        url = str(dig(c, "remote", default=""))
        lb["remote"].setText(remote_summary(c))
        lb["remote"].setToolTip(url)
        self.remote_bar.set_usage(number(c, "remote_bytes") if url else None, budget(c, "remote_max_bytes"))
        if not url and c:
            self.remote_bar.setFormat("not used")
        self.remote_bar.setToolTip(f"{url}: every engine's entries, and anything else the store holds" if url else "")
        self._slots_budget = budget(c, "slots")
        if self._parked is None:
            entries = number(c, "entries")
            if entries is None and (number(c, "entries_ram") is not None or number(c, "entries_disk") is not None):
                entries = (number(c, "entries_ram") or 0) + (number(c, "entries_disk") or 0)
            self.slots_bar.set_usage(entries, self._slots_budget, unit="count")
        else:
            self.slots_bar.set_usage(self._parked, self._slots_budget, unit="count")

    def set_parked(self, count: int | None) -> None:
        """How many conversations /cache/conversations lists, against the slots budget (None: use the counts)."""
        self._parked = count
        if count is not None:
            self.slots_bar.set_usage(count, self._slots_budget, unit="count")


def _rate(x: float | None) -> str:
    return format_count(x)  # one thousands separator everywhere


def _timing(c: dict[str, Any], key: str, mib_per_s: float | None) -> str:
    """"last 4.0 ms · median 4.0 ms · p95 4.0 ms · 715 MiB/s"; "–" while there was no such event (not "0.0 ms")."""
    count = number(c, key, "count")
    if count is None:  # an engine that does not count per timing: its event counter says the same
        count = number(c, {"park_ms": "parks", "restore_ms": "restores"}[key])
    if count == 0 or (count is None and number(c, key, "last") is None):
        return "–"
    last, p50, p95 = number(c, key, "last"), number(c, key, "p50"), number(c, key, "p95")
    text = f"last {format_ms(last)} · median {format_ms(p50)} · p95 {format_ms(p95)}"
    if mib_per_s is not None:
        text += f" · {format_count(mib_per_s)} MiB/s"
    return text


def remote_summary(cache: dict[str, Any]) -> str:
    """The shared store as /metrics reports it: "up · 3 restores · 0 errors · 0 refused", then what failed last;
    "not used" without --conversation-cache-remote."""
    if not dig(cache, "remote", default=""):
        return "not used"
    text = (f"{dig(cache, 'remote_state', default='–')} · {format_count(number(cache, 'remote_hits'))} restores · "
            f"{format_count(number(cache, 'remote_errors'))} errors · "
            f"{format_count(number(cache, 'remote_refused'))} refused")
    error = str(dig(cache, "remote_error", default=""))
    return f"{text}\n{error}" if error else text


def runs_as(engine: dict[str, Any]) -> str:
    """How the engine computes, from /metrics' engine block: e.g. "int4 weights (native kernel) · K/V float32 ·
    2 threads, 1 for decoding" (the weights format --cpu-weights auto chose and the 4-bit kernel it runs on, the
    K/V dtype, --threads and --decode-threads)."""
    weights, kv = dig(engine, "weights_format", default="–"), dig(engine, "kv_dtype", default="–")
    kernel_name = dig(engine, "int4_kernel", default="")
    kernel = {"blocks": "native", "aten": "PyTorch's"}.get(kernel_name, "") if isinstance(kernel_name, str) else ""
    text = f"{weights} weights{f' ({kernel} kernel)' if kernel else ''} · K/V {kv}"
    threads, decoding = number(engine, "threads"), number(engine, "decode_threads")
    if threads:
        text += f" · {format_count(threads)} threads, {format_count(decoding)} for decoding"
    return text
