"""The Monitor, Settings questions and Logs against the stand-in engine: layout at small sizes, the timing plot,
one row per conversation across tiers, the eviction warning, log files.
"""

from __future__ import annotations

import dataclasses
import os

os.environ["QT_QPA_PLATFORM"] = "offscreen"

import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QMessageBox

from desktop.engine_process import EngineState
from engine.figures import Timing
from tests.test_desktop_support import conversation_row, event, metrics_body, stand_in_window, wait_ready

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def window(qtbot, tmp_path):
    yield from stand_in_window(qtbot, tmp_path)


ready = wait_ready


def _overlaps(widgets) -> list[tuple[str, str]]:
    from PySide6.QtCore import QRect

    rects = [(w.text() if hasattr(w, "text") else w.objectName(), QRect(w.mapToGlobal(w.rect().topLeft()), w.size()))
             for w in widgets if w.isVisible()]
    return [(a, b) for i, (a, ra) in enumerate(rects) for b, rb in rects[i + 1:] if ra.intersects(rb)]


def test_monitor_at_800x560_scrolls_instead_of_overlapping_rows(qtbot, window):
    from PySide6.QtWidgets import QLabel, QProgressBar

    window.start()
    ready(qtbot, window)
    qtbot.waitUntil(lambda: window.monitor.counters.labels["storage"].text() == "ram", timeout=5000)
    window.resize(800, 560)
    qtbot.wait(100)
    assert window.size().width() == 800 and window.size().height() == 560, "800x560 is allowed"
    window.resize(300, 200)
    qtbot.wait(50)
    assert window.width() >= 700 and window.height() >= 500, "a minimum size"
    window.resize(800, 560)
    qtbot.wait(100)
    counters = window.monitor.counters
    parts = counters.findChildren(QLabel) + counters.findChildren(QProgressBar)
    for part in parts:
        if part.isVisible():
            assert part.height() >= part.minimumSizeHint().height(), f"{part.objectName()} squeezed"
    assert _overlaps(parts) == []
    assert window.monitor.table.height() >= window.monitor.table.minimumHeight()
    assert window.monitor.scroll.verticalScrollBar().maximum() > 0, "the Monitor scrolls at this size"


def test_the_parked_list_shows_rows_and_plot_titles_fit_at_small_sizes(qtbot, window):
    """At 1366x768 the first screen showed 1.3 rows of the parked list (the counters' height pushed it down); at
    800x560 the plots were cut by the counters beside them and their titles clipped at both ends."""
    from PySide6.QtCore import QPoint, QRect

    window.start()
    ready(qtbot, window)
    monitor = window.monitor
    qtbot.waitUntil(lambda: monitor.model.rowCount() == 2, timeout=5000)
    table, port = monitor.table, monitor.scroll.viewport()

    def rows_in_view() -> float:
        """Rows of the parked list the Monitor shows without scrolling."""
        shown = QRect(table.viewport().mapTo(port, QPoint(0, 0)), table.viewport().size()).intersected(port.rect())
        return shown.height() / table.verticalHeader().defaultSectionSize()

    window.resize(1200, 708)  # the first size on a 1366x768 screen (main_window.default_size)
    qtbot.wait(100)
    assert monitor.scroll.verticalScrollBar().value() == 0 and rows_in_view() >= 4, rows_in_view()
    window.poller.stop()  # the figures of the real engine on this machine (the stand-in reports shorter ones)
    monitor.counters.labels["compute"].setText("int4 weights (native kernel) · K/V float32 · 2 threads, "
                                               "1 for decoding")
    monitor.counters.labels["park_ms"].setText("last 2.1 ms · median 2.3 ms · p95 2.4 ms · 1\u202f901 MiB/s")
    window.resize(800, 560)
    qtbot.wait(100)
    counters_left = monitor.counters.mapTo(monitor, QPoint(0, 0)).x()
    for plot in (monitor.memory.engine_plot, monitor.memory.host_plot, monitor.timings.plot):
        item = plot.getPlotItem()
        assert plot.mapTo(monitor, QPoint(plot.width(), 0)).x() <= counters_left, "not under the counters"
        # pyqtgraph widens the plot to its title's width: the view then shows only its left part, cut.
        assert item.sceneBoundingRect().width() <= plot.viewport().width(), "the whole plot is in view"
        title = item.titleLabel.item.boundingRect().width()
        assert title <= item.vb.width(), (item.titleLabel.text, title, item.vb.width())


def test_layout_does_not_jump(qtbot, window):
    """The status bar's first message and a missed poll or two during generation move nothing."""
    window.resize(window.minimumSize())
    qtbot.wait(50)
    size = window.size()
    central = window.centralWidget().geometry()
    window.statusBar().showMessage("Purged all: dropped 2 conversation(s), 4.8 MiB.")
    qtbot.wait(50)
    assert window.size() == size and window.centralWidget().geometry() == central


    # The Monitor alone (no poller answering in between): a missed poll is what the poller reports.
    from desktop.monitor import MonitorTab

    monitor = MonitorTab()
    qtbot.addWidget(monitor)
    monitor.set_engine_state(EngineState.READY)
    monitor.resize(900, 700)
    monitor.show()
    qtbot.wait(20)
    purge_at = monitor.purge_button.mapTo(monitor, monitor.purge_button.rect().topLeft())
    monitor.set_unreachable("no answer within 2 s")
    monitor.set_unreachable("no answer within 2 s")
    qtbot.wait(20)
    assert monitor.banner.isHidden(), "one or two missed polls (a long generation step) show nothing"
    assert monitor.purge_button.mapTo(monitor, monitor.purge_button.rect().topLeft()) == purge_at
    monitor.clear_unreachable()
    monitor.set_unreachable("no answer within 2 s")
    monitor.set_unreachable("no answer within 2 s")
    assert monitor.banner.isHidden(), "an answer in between starts the count again"
    monitor.set_unreachable("no answer within 2 s")
    assert not monitor.banner.isHidden() and "did not answer" in monitor.banner.text()
    monitor.clear_unreachable()
    assert monitor.banner.isHidden()


def test_the_plots_placeholder_is_gone_as_soon_as_the_plots_are_built(qtbot):
    """Shown first, its label must not paint through the plots before the event loop deletes it."""
    from PySide6.QtWidgets import QLabel

    from desktop.monitor import MonitorTab

    tab = MonitorTab()
    qtbot.addWidget(tab)
    tab.show()
    [placeholder] = [w for w in tab.findChildren(QLabel) if w.text() == "Preparing plots…"]
    assert placeholder.isVisible()
    tab.ensure_plots()
    assert not placeholder.isVisible() and tab.memory is not None
    qtbot.waitUntil(tab.memory.isVisible, timeout=2000)


def test_timing_plot_empty_restart_and_legend(qtbot):
    import time

    from desktop.monitor import MonitorTab

    tab = MonitorTab()
    qtbot.addWidget(tab)
    tab.ensure_plots()
    tab.resize(1000, 700)
    tab.show()
    plot = tab.timings
    plot.redraw()
    item = plot.plot.getPlotItem()
    assert item.legend is None, "no legend box inside the plot to cover points"
    assert "Park" in item.titleLabel.text and "restore" in item.titleLabel.text
    assert plot.empty and plot.empty_label.isVisible()
    assert item.getAxis("left").style["showValues"] is False, "no made-up ms scale while empty"
    from desktop.client import sample_memory

    def scale_shown(plot_widget) -> bool:
        return plot_widget.getPlotItem().getAxis("left").style["showValues"]

    assert not scale_shown(tab.memory.engine_plot) and not scale_shown(tab.memory.host_plot)
    tab.set_memory(sample_memory(None))  # no engine process: no engine memory, host memory known
    assert not scale_shown(tab.memory.engine_plot) and scale_shown(tab.memory.host_plot)

    old = time.time() - 3600  # the previous engine's events, an hour ago
    tab.set_events([event("park", time=old, ms=40.0), event("restore", time=old + 5, ms=9.0)])
    assert not plot.empty and item.getAxis("left").style["showValues"] is True
    lo, hi = item.viewRange()[0]
    assert lo <= old <= hi
    assert item.viewRange()[1][1] >= 40.0, "the points are inside the y range"

    tab.engine_restarted()
    lo, hi = item.viewRange()[0]
    assert plot.empty and len(plot.park.data) == 0 and hi > time.time() - 5 and lo > old + 5
    assert item.getAxis("left").style["showValues"] is False

    timing = Timing(last=0.0, p50=0.0, p95=0.0, count=0)
    tab.set_metrics(metrics_body(cache={"parks": 0, "restores": 0, "park_ms": timing, "restore_ms": timing}))
    assert tab.counters.labels["park_ms"].text() == "–" and tab.counters.labels["restore_ms"].text() == "–"
    tab.set_metrics(metrics_body(cache={"parks": 0, "restores": 0, "park_ms": Timing(last=0.0)}))
    assert tab.counters.labels["park_ms"].text() == "–"


def test_tiered_conversation_shows_once_with_its_history(qtbot):
    """The engine lists a tiered conversation once per tier holding it; the table shows one row."""
    from desktop.monitor import MonitorTab
    from desktop.monitor.conversations import merge_tiers

    listed = [
        conversation_row("conv-a", "ram", tokens=1200, bytes=3_000_000, created=100.0, last_used=200.0, hits=4,
                         pending=False),
        conversation_row("conv-b", "disk", tokens=800, bytes=2_000_000, created=120.0, last_used=150.0, hits=1,
                         pending=False),
        conversation_row("conv-a", "disk", tokens=1200, bytes=1_000_000, created=90.0, last_used=180.0, hits=0,
                         pending=True),
    ]
    tab = MonitorTab()
    qtbot.addWidget(tab)
    tab.set_conversations(listed)
    model = tab.model
    assert model.rowCount() == 2
    ids = [model.index(r, 0).data() for r in range(2)]
    assert ids == ["conv-a", "conv-b"]
    a = model.rows[0]
    assert model.index(0, 3).data() == "RAM + disk" and model.index(1, 3).data() == "disk"
    assert a.hits == 4 and a.created == 90.0 and a.last_used == 200.0 and a.pending is True
    assert model.index(0, 6).data() == "4", "the hits it had in RAM are kept, not a new row with 0"
    assert model.index(0, 2).data() == "3.8 MiB"
    assert "RAM 2.9 MiB" in model.index(0, 2).data(Qt.ItemDataRole.ToolTipRole)
    alone = merge_tiers(listed[:2])
    assert [(p.row, p.ids, p.tiers, p.tokens, p.bytes, p.created, p.last_used, p.hits, p.pending) for p in alone] \
        == [(r, (r.id,), (r.tier,), r.tokens, r.bytes, r.created, r.last_used, r.hits, r.pending)
            for r in listed[:2]], "conversations in one tier pass through unchanged"


def test_a_restored_conversation_parked_again_is_one_row_and_a_branch_stays_its_own(qtbot):
    """The event log ties a disk row to the RAM row it was restored into and parked as; a partial restore does not
    (another conversation sharing its start). Rows from /cache/conversations as a tiered engine lists them."""
    from desktop.monitor import MonitorTab

    disk = conversation_row("old", "disk", tokens=213, bytes=9_000_000, created=100.0, last_used=300.0, hits=5,
                            name="apples", system="")
    ram = conversation_row("new", "ram", tokens=230, bytes=10_000_000, created=301.0, last_used=301.0, hits=0,
                           name="apples", system="", priority="high")
    restored = event("restore", time=300.0, conversation_id="old", tokens=213, tier="disk")
    parked = event("park", time=301.0, conversation_id="new", tokens=230, tier="ram")
    tab = MonitorTab()
    qtbot.addWidget(tab)
    tab.set_conversations([disk, ram])
    assert tab.model.rowCount() == 2, "without the event log nothing ties them"
    tab.set_events([restored, parked])
    assert tab.model.rowCount() == 1
    row = tab.model.rows[0]
    assert row.id == "new" and row.ids == ("new", "old") and row.priority == "high", "the live id speaks"
    assert row.tiers == ("ram", "disk") and row.hits == 5 and row.tokens == 230 and row.created == 100.0
    assert tab.model.index(0, 3).data() == "RAM + disk" and tab.model.index(0, 6).data() == "5"
    tab.set_conversations([disk, ram])  # the next poll keeps it one row
    assert tab.model.rowCount() == 1
    tab.set_conversations([ram])  # the disk copy superseded: the link goes with it
    assert tab.model.links == {} and [r.row for r in tab.model.rows] == [ram]

    branch = MonitorTab()
    qtbot.addWidget(branch)
    branch.set_events([dataclasses.replace(restored, tokens=64), parked])  # only its start was restored
    branch.set_conversations([disk, ram])
    assert branch.model.rowCount() == 2


def test_purge_counts_a_tiered_conversation_once(qtbot, window):
    window._on_conversations([conversation_row("x", "ram", bytes=10), conversation_row("x", "disk", bytes=5)])
    assert window.purger.summary("all")[0] == 1
    assert window.purger.summary("ram")[0] == 1 and window.purger.summary("disk")[0] == 1


def test_a_smaller_budget_says_what_it_evicts_and_asks_first(qtbot, window):
    window.start()
    ready(qtbot, window)
    qtbot.waitUntil(lambda: window.conversations is not None and len(window.conversations) == 2, timeout=5000)
    qtbot.waitUntil(lambda: window.metrics is not None, timeout=5000)
    tab = window.settings_tab
    tab.set_text("conversation_cache_mib", "2")  # conv-a (2.9 MiB, in RAM) no longer fits: asked, not sent
    box = window.live.box
    assert box is not None, "asked before applying"
    assert "drops 1 of 1 parked conversation (2.9 MiB) from RAM, to fit the RAM budget of 2 MiB" in box.text()
    assert "estimate" in box.text()
    box.button(QMessageBox.StandardButton.Cancel).click()
    qtbot.waitUntil(lambda: "Not applied" in tab.result.text(), timeout=3000)
    assert "kept RAM budget = 4096" in tab.result.text()
    assert window.engine.config.conversation_cache_mib == 4096, "nothing was sent"
    assert window.store.value("conversation_cache_mib") == 4096, "Cancel puts the value back: a restart keeps it"
    assert tab.rows["conversation_cache_mib"].text() == "4096"
    assert "not applied yet: RAM budget" not in tab.pending.text()
    tab.set_text("conversation_cache_mib", "2")
    window.live.box.button(QMessageBox.StandardButton.Yes).click()
    qtbot.waitUntil(lambda: "Applied to the running engine" in tab.result.text(), timeout=5000)
    assert window.engine.config.conversation_cache_mib == 2

    tab.set_text("conversation_cache_mib", "8 GiB")  # growing evicts nothing: applied without a question
    assert window.live.box is None
    qtbot.waitUntil(lambda: window.engine.config.conversation_cache_mib == 8192, timeout=5000)


def test_eviction_estimate_replays_lru():
    from desktop import eviction
    from desktop.monitor.conversations import merge_tiers

    mib = 1 << 20
    rows = merge_tiers([conversation_row("new", "ram", bytes=10 * mib, last_used=300),
                        conversation_row("mid", "ram", bytes=20 * mib, last_used=200),
                        conversation_row("mid", "disk", bytes=10 * mib, last_used=200),
                        conversation_row("old", "disk", bytes=40 * mib, last_used=100)])
    running = {"conversation_cache_mib": 2048, "conversation_cache_disk_mib": 2048, "conversation_cache_slots": 64}
    ram = eviction.estimate(rows, "tiered", running, {"conversation_cache_mib": 25})
    assert ram == [eviction.Eviction("ram", 1, 20 * mib, 2, "25 MiB", spilled=True)]
    assert "moves 1 of 2 parked conversations (20.0 MiB) from RAM to disk" in eviction.describe(ram)
    disk = eviction.estimate(rows, "tiered", running, {"conversation_cache_disk_mib": 45})
    assert disk == [eviction.Eviction("disk", 1, 40 * mib, 2, "45 MiB")], "the older one goes"
    assert eviction.estimate(rows, "ram", running, {"conversation_cache_disk_mib": 1}) == [], "disk unused"
    # the slot count holds in each tier: RAM keeps "new" and writes "mid" (20 MiB, over its 10 MiB disk copy) to
    # disk, where it takes the one place from "old"
    slots = eviction.estimate(rows, "tiered", running, {"conversation_cache_slots": 1})
    assert slots == [eviction.Eviction("ram", 1, 20 * mib, 2, "2 GiB, at most 1 conversation", spilled=True),
                     eviction.Eviction("disk", 1, 40 * mib, 2, "2 GiB, at most 1 conversation")]
    assert eviction.estimate(rows, "tiered", running, {"conversation_cache_mib": 4096}) == []


def test_eviction_estimate_follows_the_engines_order_and_a_switch_to_disk():
    """Unpinned before pinned, low before normal before high, the least recently used first among those, taken
    until the rest fits (engine/cache/policy.py); a switch to disk storage writes the RAM ones to disk."""
    from desktop import eviction
    from desktop.monitor.conversations import merge_tiers

    mib = 1 << 20
    rows = merge_tiers([conversation_row("low", "ram", bytes=10 * mib, last_used=400, priority="low"),
                        conversation_row("normal", "ram", bytes=10 * mib, last_used=300),
                        conversation_row("high", "ram", bytes=10 * mib, last_used=200, priority="high"),
                        conversation_row("pinned", "ram", bytes=10 * mib, last_used=100, pinned=True)])
    running = {"conversation_cache_mib": 2048, "conversation_cache_disk_mib": 2048, "conversation_cache_slots": 64}
    ram = eviction.estimate(rows, "ram", running, {"conversation_cache_mib": 25})
    assert ram == [eviction.Eviction("ram", 2, 20 * mib, 4, "25 MiB")], "low and normal go, not the oldest two"
    slots = eviction.estimate(rows, "ram", running, {"conversation_cache_slots": 1})
    assert slots == [eviction.Eviction("ram", 3, 30 * mib, 4, "2 GiB, at most 1 conversation")], "the pinned stays"
    # taken until the rest fits: the recent 30 MiB alone is over 25 MiB, so both go (not the small old one kept)
    two = merge_tiers([conversation_row("recent", "ram", bytes=30 * mib, last_used=200),
                       conversation_row("older", "ram", bytes=5 * mib, last_used=100)])
    assert eviction.estimate(two, "ram", running, {"conversation_cache_mib": 25}) == [
        eviction.Eviction("ram", 2, 35 * mib, 2, "25 MiB")]
    # RAM -> disk: the four are written to disk, whose budget (unchanged, 30 MiB) then drops one
    to_disk = eviction.estimate(rows, "ram", {**running, "conversation_cache_disk_mib": 30},
                                {"conversation_cache_storage": "disk"})
    assert to_disk == [eviction.Eviction("disk", 1, 10 * mib, 4, "30 MiB")]
    assert "drops 1 of 4 parked conversations (10.0 MiB) from disk" in eviction.describe(to_disk)
    assert eviction.estimate(rows, "ram", running, {"conversation_cache_storage": "disk"}) == [], "they fit"
    assert eviction.estimate(rows, "disk", {**running, "conversation_cache_disk_mib": 30},
                             {"conversation_cache_n_min": 5}) == [], "an unchanged tier is not second-guessed"
    # written one at a time, least recently used first, each making room as a spill does: "high" (written before
    # "normal" and "low") is not pushed out by them, and "low", last, finds only higher ones and is itself dropped
    to_small = eviction.estimate(rows, "ram", {**running, "conversation_cache_disk_mib": 20},
                                 {"conversation_cache_storage": "disk"})
    assert to_small == [eviction.Eviction("disk", 2, 20 * mib, 4, "20 MiB")]
    # a disk budget of 0 leaves the disk unused (its files stay): nothing dropped there, RAM's overflow is lost
    gone = eviction.estimate(rows, "tiered", running, {"conversation_cache_disk_mib": 0, "conversation_cache_mib": 25})
    assert gone == [eviction.Eviction("ram", 2, 20 * mib, 4, "25 MiB")]


def test_logs_tab_counts_filters_and_says_when_follow_is_off(qtbot):
    from desktop.logs_tab import LogsTab

    tab = LogsTab()
    qtbot.addWidget(tab)
    tab.show()
    for i in range(30):
        tab.append_line(f"{'WARNING' if i % 10 == 0 else 'INFO'} step {i}")
    tab.search.setText("warning")
    assert tab.search_status.text() == "3 matches"
    tab.append_line("WARNING late")
    assert tab.search_status.text() == "4 matches", "the count follows new lines"
    tab.filter.setChecked(True)
    assert tab.text().splitlines() == ["WARNING step 0", "WARNING step 10", "WARNING step 20", "WARNING late"]
    tab.append_line("INFO hidden")
    tab.append_line("WARNING shown")
    assert tab.text().splitlines()[-1] == "WARNING shown" and "INFO hidden" not in tab.text()
    tab.filter.setChecked(False)
    assert len(tab.text().splitlines()) == 33, "every line is back"
    assert tab.follow_off.isHidden()
    tab.find_next()  # reading a match turns Follow off, and the tab says so
    assert not tab.follow.isChecked() and not tab.follow_off.isHidden()
    tab.follow.setChecked(True)
    assert tab.follow_off.isHidden()
    tab.search.setText("nothing like this")
    assert tab.search_status.text() == "not found"


def test_engine_and_app_lines_go_to_rotating_files_in_the_log_folder(qtbot, tmp_path):
    from desktop.log_files import DESKTOP_LOG, ENGINE_LOG, LogFiles

    files = LogFiles(tmp_path / "logs", max_bytes=2000, backups=2)
    for i in range(100):
        files.write_line(f"engine line {i} " + "x" * 40)
    files.write_line("strata-desktop: the engine was killed by SIGKILL")
    files.close()
    engine_logs = sorted(p.name for p in (tmp_path / "logs").glob(ENGINE_LOG + "*"))
    assert engine_logs == [ENGINE_LOG, ENGINE_LOG + ".1", ENGINE_LOG + ".2"], "rotated, two kept"
    assert "engine line 99" in (tmp_path / "logs" / ENGINE_LOG).read_text()
    assert all(p.stat().st_size <= 2100 for p in (tmp_path / "logs").iterdir())
    desktop = (tmp_path / "logs" / DESKTOP_LOG).read_text()
    assert "killed by SIGKILL" in desktop and "engine line" not in desktop


def test_window_writes_the_logs_to_its_log_folder(qtbot, window):
    window.start()
    ready(qtbot, window)
    logs = window.paths.logs
    assert window.logs.log_dir == logs and window.logs.folder_button.isEnabled()
    window.stop_button.click()
    qtbot.waitUntil(lambda: window.engine.state is EngineState.STOPPED, timeout=10000)
    window.shutdown_now()  # closes the files: what was queued is written
    assert "strata: listening on" in (logs / "engine.log").read_text()
    assert "strata-desktop: starting" in (logs / "desktop.log").read_text()


def test_memory_panel_draws_the_expert_arena_as_its_own_band(qtbot):
    """A MoE engine's expert arena (engine.expert_arena_bytes) is a shaded band from zero under the RSS line,
    named with its size in the plot's title, from samples taken before the plots existed too; a dense model
    has none."""
    import time

    import numpy as np

    from desktop.client import MemorySample
    from desktop.monitor import MonitorTab

    mib = 1 << 20
    tab = MonitorTab()
    qtbot.addWidget(tab)
    tab.set_metrics(metrics_body({"expert_arena_bytes": 300 * mib}))
    now = time.time()
    tab.set_memory(MemorySample(now - 2, 500 * mib, 8000 * mib, 16000 * mib))  # before the plots are built
    tab.ensure_plots()
    tab.resize(1000, 700)
    tab.show()
    tab.set_memory(MemorySample(now - 1, 520 * mib, 7990 * mib, 16000 * mib))
    memory = tab.memory
    memory.redraw()
    x, y = memory.arena_curve.getData()
    assert memory.arena_curve.isVisible() and list(y) == [300.0, 300.0] and len(x) == 2
    assert memory.arena_curve.opts["fillLevel"] == 0 and memory.arena_curve.opts["fillBrush"] is not None
    assert "expert arena 300 MiB" in memory.engine_plot.getPlotItem().titleLabel.text
    assert memory.engine_plot.getPlotItem().viewRange()[1][1] >= 520, "RSS line and band inside the y range"
    items = memory.engine_plot.getPlotItem().listDataItems()
    assert items.index(memory.arena_curve) < items.index(memory.engine_curve), "the RSS line is drawn on top"

    tab.set_metrics(metrics_body({"expert_arena_bytes": 0}))  # a dense model now
    tab.set_memory(MemorySample(now, 400 * mib, 8100 * mib, 16000 * mib))
    memory.redraw()
    assert "expert arena" not in memory.engine_plot.getPlotItem().titleLabel.text
    assert np.array_equal(memory.arena_curve.getData()[1], [300.0, 300.0, 0.0])
    assert memory.arena_curve.isVisible(), "the earlier samples' band stays while they are in view"


def test_a_hybrid_conversation_shows_its_checkpoints_and_their_bytes(qtbot):
    """Rows from a real hybrid-model cache, in the shape GET /cache/conversations answers: the list shows how many
    checkpoints a conversation can resume from and what they take; an attention-only row shows none."""
    from desktop.monitor import MonitorTab
    from desktop.settings import format_bytes
    from engine.contract import ConversationRow, ConversationsBody, parse, to_json
    from tests.test_cache_checkpoints import Slots, hybrid, park
    from tests.test_cache_support import BLOCK, conversation, make_cache

    ident = hybrid()
    cache, slots = make_cache(ident, storage="ram"), Slots()
    tokens = conversation(2, 3 * BLOCK + 5)
    assert park(cache, slots, tokens, [BLOCK, 2 * BLOCK + 3, len(tokens)]).parked
    rows = [c.to_dict() for c in cache.conversations()]
    cache.close(spill=False)
    body = parse(ConversationsBody, to_json(ConversationsBody([parse(ConversationRow, r) for r in rows])))
    listed = body.conversations
    assert listed[0].checkpoints == 3 and listed[0].checkpoint_bytes == 3 * ident.state_bytes
    plain = dataclasses.replace(listed[0], id="plain", checkpoints=0, checkpoint_bytes=0)

    tab = MonitorTab()
    qtbot.addWidget(tab)
    tab.set_conversations([*listed, plain])
    model = tab.model
    col = model.COLUMNS.index("Checkpoints")
    assert model.headerData(col, Qt.Orientation.Horizontal) == "Checkpoints"
    assert model.index(0, col).data() == f"3 · {format_bytes(3 * ident.state_bytes)}"
    assert "resume" in model.index(0, col).data(Qt.ItemDataRole.ToolTipRole)
    assert model.index(1, col).data() == "–"


def test_a_pause_in_typing_a_budget_neither_applies_nor_asks(qtbot, window):
    from PySide6.QtCore import Qt
    from PySide6.QtTest import QTest

    from desktop.settings_tab import SETTLE_MS

    window.start()
    ready(qtbot, window)
    qtbot.waitUntil(lambda: window.conversations is not None and len(window.conversations) == 2, timeout=5000)
    qtbot.waitUntil(lambda: window.metrics is not None, timeout=5000)
    tab = window.settings_tab
    editor = tab.rows["conversation_cache_mib"].editor
    editor.setFocus()
    editor.selectAll()
    QTest.keyClicks(editor, "2")
    qtbot.wait(SETTLE_MS + 400)
    assert window.live.box is None, "no question in the middle of typing"
    assert window.engine.config.conversation_cache_mib == 4096, "nothing half-typed was applied"
    QTest.keyClicks(editor, "048")
    QTest.keyClick(editor, Qt.Key.Key_Return)
    assert window.live.box is None, "2048 MiB evicts nothing: applied without a question"
    qtbot.waitUntil(lambda: window.engine.config.conversation_cache_mib == 2048, timeout=5000)


def test_the_remote_store_shows_its_state_figures_and_bytes_against_its_maxmemory(qtbot):
    from desktop.monitor.counters import CountersPanel

    panel = CountersPanel()
    qtbot.addWidget(panel)
    panel.set_metrics(metrics_body())
    assert panel.labels["remote"].text() == "not used" and panel.remote_bar.format() == "not used"
    cache = {"storage": "ram", "remote": "redis://team:***@10.0.0.5:6379/0", "remote_state": "down",
             "remote_error": "down: cannot reach the store", "remote_hits": 3, "remote_errors": 2,
             "remote_refused": 1, "remote_bytes": 64 << 20, "remote_max_bytes": 256 << 20}
    panel.set_metrics(metrics_body(cache=cache))
    text = panel.labels["remote"].text()
    assert text.startswith("down · 3 restores · 2 errors · 1 refused") and "cannot reach" in text
    assert "(25%)" in panel.remote_bar.format() and "***" in panel.labels["remote"].toolTip()
