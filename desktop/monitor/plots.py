"""Scrolling plots: engine and host memory over wall-clock time (with a MoE model's expert arena as a band),
and park/restore timings of recent events."""

from __future__ import annotations

import html
import time
from typing import Any

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtGui import QFont, QFontMetrics, QTextDocument, QTextDocumentFragment
from PySide6.QtWidgets import QVBoxLayout, QWidget

from desktop.client import MemorySample
from desktop.monitor.ring import RingBuffer
from engine.contract import Event

MIB = 1024 * 1024
HISTORY = 1800  # samples kept per series: 30 min at the 1 s refresh
WINDOW_S = 300  # the memory plots scroll over the last 5 minutes
ENGINE_PEN = pg.mkPen("#1f77b4", width=2)
HOST_PEN = pg.mkPen("#2ca02c", width=2)
FLOOR_PEN = pg.mkPen("#d62728", width=1, style=Qt.PenStyle.DashLine)
ARENA_COLOR = "#9467bd"
ARENA_PEN = pg.mkPen(ARENA_COLOR, width=1)
ARENA_BRUSH = pg.mkBrush(148, 103, 189, 70)
ENGINE_TITLE = "Engine memory (RSS of its process tree)"
ENGINE_TITLES = (ENGINE_TITLE, "Engine memory (RSS)", "Engine RSS")
HOST_TITLES = ("Available host memory", "Host memory free", "Host free")
PARK_BRUSH = pg.mkBrush("#ff7f0e")
RESTORE_BRUSH = pg.mkBrush("#1f77b4")
PARK_KEY, RESTORE_KEY = "<span style='color:#ff7f0e'>&#9679;</span>", "<span style='color:#1f77b4'>&#9650;</span>"
TIMING_TITLE = f"Park {PARK_KEY} and restore {RESTORE_KEY} times (recent events)"
TIMING_TITLES = (TIMING_TITLE, f"Park {PARK_KEY} and restore {RESTORE_KEY} times", f"Park {PARK_KEY} restore {RESTORE_KEY}")
TITLE_PT = 10


def title_width(html: str, font: QFont) -> float:
    """How wide a title's rich text is drawn in `font`."""
    doc = QTextDocument()
    doc.setDocumentMargin(0)
    doc.setDefaultFont(font)
    doc.setHtml(html)
    return doc.idealWidth()


class TitledPlot(pg.PlotWidget):
    """A plot whose title fits its width: the longest of its variants that fits, else the shortest, elided.

    pyqtgraph draws a title wider than the plot cut at both ends ("Engine memory (RSS of" at 800x560), with
    nothing to say that it was cut."""

    def __init__(self, titles: tuple[str, ...], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.titles = titles
        self.title = ""

    def set_titles(self, titles: tuple[str, ...]) -> None:
        self.titles = titles
        self.fit_title()

    def resizeEvent(self, event: Any) -> None:
        super().resizeEvent(event)
        self.fit_title()

    def fit_title(self) -> None:
        if not getattr(self, "titles", None) or self.getPlotItem() is None:
            return  # a resize while pyqtgraph builds the widget
        font = QFont(self.font())
        font.setPointSizeF(TITLE_PT)
        # The title sits above the data area only: the plot less its value axis and margins.
        room = int(self.width() - self.getPlotItem().getAxis("left").width() - 16)
        # Not laid out yet (hidden): the full title, fitted once the plot has its size.
        title = self.titles[0] if not self.isVisible() else next(
            (t for t in self.titles if title_width(t, font) <= room), None)
        if title is None:
            plain = QTextDocumentFragment.fromHtml(self.titles[-1]).toPlainText()
            title = html.escape(QFontMetrics(font).elidedText(plain, Qt.TextElideMode.ElideRight, max(room, 0)))
        if title != self.title:
            self.title = title
            self.getPlotItem().setTitle(title, color="#333", size=f"{TITLE_PT}pt")
            if self.centralWidget is not None:  # laid out again: a shorter title lowers the plot's minimum width
                self.centralWidget.setGeometry(self.range)


def _plot(titles: tuple[str, ...], y_label: str) -> TitledPlot:
    w = TitledPlot(titles, background="w", axisItems={"bottom": pg.DateAxisItem(orientation="bottom")})
    item = w.getPlotItem()
    w.fit_title()
    item.setLabel("left", y_label)
    item.showGrid(x=True, y=True, alpha=0.2)
    item.setMenuEnabled(False)
    item.getAxis("left").setWidth(56)  # the same width in every plot, so stacked time axes line up
    item.getAxis("left").setStyle(showValues=False)  # until there is data (see _y_from_zero)
    item.setClipToView(True)
    item.setDownsampling(auto=True, mode="peak")
    w.setMinimumHeight(110)  # three stacked leave the parked list room at 1366x768
    return w


def _y_from_zero(plot: pg.PlotWidget, y: np.ndarray, at_least: float = 0.0) -> None:
    """Y from zero to a little above the data; with nothing to show, no value scale (0–1 would read as data)."""
    finite = y[np.isfinite(y)]
    top = max(float(finite.max()) if finite.size else 0.0, at_least)
    plot.getPlotItem().getAxis("left").setStyle(showValues=top > 0)
    plot.setYRange(0, top * 1.15 if top > 0 else 1.0, padding=0)


class MemoryPlots(QWidget):
    """Engine RSS (its process tree) and free host memory with the cache's min-free floor.

    A mixture-of-experts model's expert arena (the routed experts resident in host RAM, which the engine
    reports) is a shaded band from zero under the RSS line: the part of the engine's memory parked
    conversations cannot have."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.engine_rss = RingBuffer(HISTORY)
        self.host_available = RingBuffer(HISTORY)
        self.expert_arena = RingBuffer(HISTORY)
        self.arena_bytes = 0  # the engine's last report; sampled with each memory sample
        self.engine_plot = _plot(ENGINE_TITLES, "MiB")
        self.host_plot = _plot(HOST_TITLES, "MiB")
        self.host_plot.setXLink(self.engine_plot)
        # Added first, so the RSS line is drawn over the band.
        self.arena_curve = self.engine_plot.plot(pen=ARENA_PEN, fillLevel=0, brush=ARENA_BRUSH)
        self.arena_curve.setVisible(False)
        self.engine_curve = self.engine_plot.plot(pen=ENGINE_PEN, connect="finite")
        self.host_curve = self.host_plot.plot(pen=HOST_PEN, connect="finite")
        self.floor_line = pg.InfiniteLine(angle=0, pen=FLOOR_PEN, movable=False,
                                          label="min-free floor {value:.0f} MiB",
                                          labelOpts={"position": 0.1, "color": "#d62728", "anchors": [(0, 1), (0, 1)]})
        self.floor_line.setVisible(False)
        self.host_plot.addItem(self.floor_line, ignoreBounds=False)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.engine_plot)
        layout.addWidget(self.host_plot)
        self._dirty = False

    def add_sample(self, sample: MemorySample) -> None:
        self.engine_rss.append(sample.time, None if sample.engine_rss is None else sample.engine_rss / MIB)
        self.host_available.append(sample.time, sample.host_available / MIB)
        self.expert_arena.append(sample.time, self.arena_bytes / MIB)
        self._dirty = True

    def set_arena(self, arena_bytes: int) -> None:
        """The expert arena the engine reports (0: a dense model, or experts in GPU memory)."""
        self.arena_bytes = max(int(arena_bytes), 0)
        titles = ENGINE_TITLES
        if self.arena_bytes:
            band = f"<span style='color:{ARENA_COLOR}'>&#9632;</span>"
            arena = f"{self.arena_bytes / MIB:.0f} MiB"
            titles = (f"{ENGINE_TITLE} · {band} expert arena {arena}", f"Engine memory · {band} expert arena {arena}",
                      f"Engine RSS · {band} experts {arena}", f"Engine RSS · {band} {arena}")
        self.engine_plot.set_titles(titles)

    def set_floor(self, floor_bytes: float | None) -> None:
        if floor_bytes is None:
            self.floor_line.setVisible(False)
            return
        self.floor_line.setVisible(True)
        self.floor_line.setValue(floor_bytes / MIB)
        self.floor_line.label.valueChanged()  # the label skips updates while hidden

    def redraw(self) -> None:
        if not self._dirty:
            return
        self._dirty = False
        x, y = self.engine_rss.data()
        hx, hy = self.host_available.data()
        self.engine_curve.setData(x, y)
        self.host_curve.setData(hx, hy)
        ax, ay = self.expert_arena.data()
        self.arena_curve.setVisible(bool(len(ay)) and float(ay.max()) > 0)
        self.arena_curve.setData(ax, ay)
        # From zero, so a flat line looks flat instead of magnifying noise.
        _y_from_zero(self.engine_plot, y, float(ay.max()) if len(ay) else 0.0)
        floor = self.floor_line.value() if self.floor_line.isVisible() else 0.0
        _y_from_zero(self.host_plot, hy, floor)
        if len(x):
            # The last WINDOW_S seconds once there is that much; at least a minute before that.
            lo = max(x[0], x[-1] - WINDOW_S) if x[-1] - x[0] >= 60 else x[-1] - 60
            self.engine_plot.setXRange(lo, x[-1], padding=0)


class TimingPlot(QWidget):
    """Duration of each recent park and restore the engine reported, over time.

    The key is in the title, not a legend box inside the plot, so it never covers a point. Empty, the plot says
    so and shows no value scale (pyqtgraph's default 0–1 range would read as a fake 0.2–0.8 ms).
    """

    EMPTY_TEXT = "no parks or restores yet"

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.plot = _plot(TIMING_TITLES, "ms")
        self.park = pg.ScatterPlotItem(size=7, brush=PARK_BRUSH, pen=None, name="park")
        self.restore = pg.ScatterPlotItem(size=7, brush=RESTORE_BRUSH, pen=None, symbol="t", name="restore")
        self.plot.addItem(self.park)
        self.plot.addItem(self.restore)
        self.empty_label = pg.TextItem(self.EMPTY_TEXT, color="#777", anchor=(0.5, 0.5))
        self.plot.addItem(self.empty_label, ignoreBounds=True)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.plot)
        self._events: list[Event] = []
        self._dirty = True
        self._shown_key: tuple | None = None
        self.empty = True

    def set_events(self, events: list[Event]) -> None:
        self._events = events
        self._dirty = True

    def reset(self) -> None:
        """A new engine: forget the previous one's events and time axis."""
        self.set_events([])
        self._shown_key = None
        self.redraw()

    def redraw(self) -> None:
        if not self._dirty:
            return
        self._dirty = False
        points: dict[str, tuple[list[float], list[float]]] = {"park": ([], []), "restore": ([], [])}
        for ev in self._events:
            if ev.kind in points:
                points[ev.kind][0].append(ev.time)
                points[ev.kind][1].append(ev.ms)
        key = tuple(len(v[0]) for v in points.values()) + tuple(v[0][-1] if v[0] else 0 for v in points.values())
        if key == self._shown_key:
            return
        self._shown_key = key
        self.park.setData(x=np.array(points["park"][0]), y=np.array(points["park"][1]))
        self.restore.setData(x=np.array(points["restore"][0]), y=np.array(points["restore"][1]))
        times = points["park"][0] + points["restore"][0]
        self.empty = not times
        self.plot.getPlotItem().getAxis("left").setStyle(showValues=not self.empty)
        self.empty_label.setVisible(self.empty)
        if self.empty:
            now = time.time()
            self.plot.setXRange(now - 60, now, padding=0)
            self.plot.setYRange(0, 1, padding=0)
            self.empty_label.setPos(now - 30, 0.5)
            return
        # At least a minute wide, so a few events do not stretch over sub-second ticks.
        hi = max(times)
        lo = min(min(times), hi - 60)
        self.plot.setXRange(lo, hi + 0.05 * (hi - lo), padding=0)
        _y_from_zero(self.plot, np.array(points["park"][1] + points["restore"][1]))
