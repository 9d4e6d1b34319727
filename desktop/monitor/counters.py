"""Counters the engine reports: hit rate, tokens saved, park/restore figures, bytes per tier against each budget."""

from __future__ import annotations

from PySide6.QtWidgets import QFormLayout, QGridLayout, QGroupBox, QLabel, QProgressBar, QVBoxLayout, QWidget

from desktop.monitor.report import format_age, format_count, format_drafts, format_ms
from desktop.settings import UNIQUE_BYTES, format_bytes
from engine.contract import Event, MetricsBody
from engine.figures import CacheFigures, EngineFigures, Timing

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
        self._cache: CacheFigures | None = None  # the last report (the timings are shown with each event poll)
        self._rates: dict[str, float] = {}
        self._parked: int | None = None
        self._slots_budget: float | None = None
        engine_box = QGroupBox("Engine")
        engine_form = QFormLayout(engine_box)
        for key, text in (("model", "Model"), ("compute", "Runs as"), ("state", "State"), ("slots", "Slots busy"),
                          ("queued", "Queued"), ("requests", "Requests"), ("speed", "Prefill / decode"),
                          ("drafts", "Draft tokens"), ("uptime", "Uptime")):
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

    def set_events(self, events: list[Event]) -> None:
        """Recent park/restore events: the newest of each kind gives the transfer rate shown beside the times."""
        self._rates = {}
        for ev in events:
            if ev.kind in ("park", "restore") and ev.ms and ev.bytes:  # an incremental re-park may move no bytes
                self._rates[ev.kind] = ev.bytes / MIB / (ev.ms / 1e3)  # MiB/s of the newest (the list is oldest first)
        self._show_timings()

    def _show_timings(self) -> None:
        c = self._cache
        self.labels["park_ms"].setText(_timing(None if c is None else c.park_ms, self._rates.get("park")))
        self.labels["restore_ms"].setText(_timing(None if c is None else c.restore_ms, self._rates.get("restore")))

    def set_metrics(self, m: MetricsBody) -> None:
        e, c = m.engine, m.conversation_cache
        lb = self.labels
        lb["model"].setText(e.model)
        lb["model"].setToolTip(e.model)
        lb["compute"].setText(runs_as(e))
        lb["state"].setText(e.state)
        lb["slots"].setText(f"{format_count(e.slots_busy)} of {format_count(e.slots)}")
        lb["queued"].setText(format_count(e.queued))
        lb["requests"].setText(format_count(e.requests))
        lb["speed"].setText(f"{_rate(e.prefill_tokens_per_s)} / {_rate(e.decode_tokens_per_s)} tokens/s")
        lb["drafts"].setText(format_drafts(e.spec_drafted_tokens, e.spec_accepted_tokens))
        lb["uptime"].setText(format_age(e.uptime_s))

        if not c.enabled:
            lb["storage"].setText("off")
        else:
            lb["storage"].setText(c.storage)
            lb["storage"].setToolTip(f"Folder: {c.dir}" if c.dir else "")
        looked_up = c.hits + c.misses
        rate = "–" if not looked_up else f"{100 * c.hits / looked_up:.0f}%"
        lb["hit_rate"].setText(f"{rate}  ({format_count(c.hits)} hits, {format_count(c.misses)} misses)")
        lb["tokens_saved"].setText(format_count(c.tokens_reused))
        lb["parks"].setText(f"{format_count(c.parks)} / {format_count(c.restores)}")
        lb["evictions"].setText(f"{format_count(c.evictions)} / {format_count(sum(c.refusals.values()))}")
        lb["evictions"].setToolTip("\n".join(f"{k}: {v}" for k, v in c.refusals.items()))
        self._cache = c
        self._show_timings()

        uses_disk = c.storage in ("disk", "tiered")
        self.ram_bar.set_usage(c.bytes_ram, c.ram_bytes)
        self.disk_bar.set_usage(c.bytes_disk if uses_disk or c.bytes_disk else None, c.disk_bytes)
        if not uses_disk and not c.bytes_disk:
            self.disk_bar.setFormat(f"not used in {c.storage} mode")
        if c.disk_error:
            self.disk_bar.setFormat("error: " + c.disk_error)
        self.disk_bar.setToolTip(c.disk_error or UNIQUE_BYTES)
        lb["remote"].setText(remote_summary(c))
        lb["remote"].setToolTip(c.remote)
        self.remote_bar.set_usage(c.remote_bytes if c.remote else None, c.remote_max_bytes or None)
        if not c.remote:
            self.remote_bar.setFormat("not used")
        self.remote_bar.setToolTip(f"{c.remote}: every engine's entries, and anything else the store holds"
                                   if c.remote else "")
        self._slots_budget = c.slots
        # /cache/conversations' count once it came (a tiered conversation in both tiers is one), else the entries.
        parked = c.entries_ram + c.entries_disk if self._parked is None else self._parked
        self.slots_bar.set_usage(parked, self._slots_budget, unit="count")

    def set_parked(self, count: int | None) -> None:
        """How many conversations /cache/conversations lists, against the slots budget (None: use the counts)."""
        self._parked = count
        if count is not None:
            self.slots_bar.set_usage(count, self._slots_budget, unit="count")


def _rate(x: float | None) -> str:
    return format_count(x)  # one thousands separator everywhere


def _timing(t: Timing | None, mib_per_s: float | None) -> str:
    """"last 4.0 ms · median 4.0 ms · p95 4.0 ms · 715 MiB/s"; "–" while there was no such event (not "0.0 ms")."""
    if t is None or t.count == 0:
        return "–"
    text = f"last {format_ms(t.last)} · median {format_ms(t.p50)} · p95 {format_ms(t.p95)}"
    if mib_per_s is not None:
        text += f" · {format_count(mib_per_s)} MiB/s"
    return text


def remote_summary(cache: CacheFigures) -> str:
    """The shared store as /metrics reports it: "up · 3 restores · 0 errors · 0 refused", then what failed last;
    "not used" without --conversation-cache-remote."""
    if not cache.remote:
        return "not used"
    text = (f"{cache.remote_state or '–'} · {format_count(cache.remote_hits)} restores · "
            f"{format_count(cache.remote_errors)} errors · {format_count(cache.remote_refused)} refused")
    return f"{text}\n{cache.remote_error}" if cache.remote_error else text


def runs_as(engine: EngineFigures) -> str:
    """How the engine computes, from /metrics' engine block: e.g. "int4 weights (native kernel) · K/V float32 ·
    2 threads, 1 for decoding" (the weights format --cpu-weights auto chose and the 4-bit kernel it runs on, the
    K/V dtype, --threads and --decode-threads)."""
    kernel = {"blocks": "native", "aten": "PyTorch's"}.get(engine.int4_kernel, "")
    text = f"{engine.weights_format} weights{f' ({kernel} kernel)' if kernel else ''} · K/V {engine.kv_dtype}"
    if engine.threads:
        text += f" · {format_count(engine.threads)} threads, {format_count(engine.decode_threads)} for decoding"
    return text
