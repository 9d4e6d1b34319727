"""End to end: the app starts the real engine on the bundled model; a person's view of the cache, purge, settings,
stop, crash and restart, quit, and an engine orphaned by a killed app. One engine serves the tests in order.
"""

from __future__ import annotations

import os

os.environ["QT_QPA_PLATFORM"] = "offscreen"

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from PySide6.QtCore import QEventLoop, Qt
from PySide6.QtTest import QTest
from PySide6.QtWidgets import QApplication, QMessageBox

from desktop.engine_process import EngineState
from desktop.main_window import MainWindow
from desktop.pid_file import read_pid_file
from desktop.settings import Paths
from engine.config import EngineConfig
from engine.figures import CacheFigures
from engine.startup_progress import PHASES, READY_PHASE

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(240)
REPO = Path(__file__).resolve().parents[1]
LOAD_TIMEOUT_MS = 120_000

SYSTEM_A = "You are a patient assistant who explains fruit to children. " * 20
SYSTEM_B = "You are a terse assistant who only talks about rivers and bridges. " * 20
CONV_A = [{"role": "system", "content": SYSTEM_A}, {"role": "user", "content": "Why are apples red? " * 20}]
CONV_B = [{"role": "system", "content": SYSTEM_B}, {"role": "user", "content": "Name a long river. " * 20}]


def pump_until(cond, timeout_s: float) -> bool:
    app = QApplication.instance()
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        app.processEvents(QEventLoop.ProcessEventsFlag.AllEvents, 50)
        if cond():
            return True
        time.sleep(0.01)
    return False


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture(scope="module")
def app_window(qapp, tmp_path_factory):
    base = tmp_path_factory.mktemp("desktop-e2e")
    w = MainWindow(Paths(base / "cfg", base / "state"), use_tray=False, environ={})
    w.store.set("port", 0)
    w.store.set("conversation_cache_dir", str(base / "parked"))
    w.seen = []  # (phase, header text, header shown) at each start-up phase the app was told of

    def seen(health) -> None:
        if health is not None:
            w.seen.append((health.phase, w.startup.phase.text(), w.startup.isVisible()))

    w.engine.health_changed.connect(seen)
    w.show()
    w.start()
    assert pump_until(lambda: w.engine.state is EngineState.READY, LOAD_TIMEOUT_MS / 1000), "\n".join(w.engine.lines)
    yield w
    w.shutdown_now()


def chat(w: MainWindow, messages: list[dict]) -> object:
    client = openai.OpenAI(base_url=w.engine.url + "/v1", api_key="unused", timeout=120)
    return client.chat.completions.create(model="default", messages=messages, max_tokens=4, temperature=0)


def cache(w: MainWindow) -> CacheFigures:
    """The cache's figures of the last /metrics answer (before the first: an empty cache's)."""
    return w.metrics.conversation_cache if w.metrics is not None else CacheFigures(enabled=False, storage="")


def test_the_header_showed_the_engines_start_up_phases_in_order(qtbot, app_window):
    w = app_window
    phases = [phase for phase, _, _ in w.seen]
    assert phases and phases[-1] == READY_PHASE, w.seen
    order = [PHASES.index(p) for p in dict.fromkeys(phases[:-1])]
    assert order == sorted(order), f"phases went backwards: {phases}"
    for phase, text, shown in w.seen:
        assert shown and text.startswith(phase), (phase, text)
    assert w.startup.isHidden(), "gone once the engine is Ready"


def test_abA_through_the_openai_sdk_shows_park_and_restore(qtbot, app_window):
    w = app_window
    assert "Ready" in w.state_label.text()
    w.tabs.setCurrentWidget(w.monitor)
    chat(w, CONV_A)
    chat(w, CONV_B)  # A is switched out of the only slot: parked
    qtbot.waitUntil(lambda: cache(w).parks >= 1, timeout=10000)
    again = chat(w, CONV_A)  # A comes back: restored instead of prefilled
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    qtbot.waitUntil(lambda: cache(w).restores >= 1, timeout=10000)
    labels = w.monitor.counters.labels
    qtbot.waitUntil(lambda: labels["parks"].text().split(" / ")[1] not in ("0", "–"), timeout=5000)
    assert labels["tokens_saved"].text() not in ("0", "–")
    engine = w.metrics.engine  # how the engine computes, as /metrics reports it
    kernel = {"blocks": " (native kernel)", "aten": " (PyTorch's kernel)", "": ""}[engine.int4_kernel]
    assert (engine.weights_format == "int4") == (kernel != "")  # the bundled model on the CPU
    assert labels["compute"].text() == (f"{engine.weights_format} weights{kernel} · K/V {engine.kv_dtype} · "
                                        f"{engine.threads} threads, {engine.decode_threads} for decoding")
    # The rate comes from /cache/events, polled apart from /metrics: wait for that poll too.
    qtbot.waitUntil(lambda: labels["restore_ms"].text().startswith("last ") and "MiB/s" in labels["restore_ms"].text(),
                    timeout=10000)
    qtbot.waitUntil(lambda: w.monitor.model.rowCount() >= 1, timeout=10000)
    tiers = {w.monitor.model.index(r, 3).data() for r in range(w.monitor.model.rowCount())}
    assert tiers == {"RAM"}
    kinds = {p for p, item in (("park", w.monitor.timings.park), ("restore", w.monitor.timings.restore))
             if len(item.data)}
    assert kinds == {"park", "restore"}, "the timing plot shows both kinds of event"
    assert w.monitor.counters.ram_bar.value() > 0


def test_purge_empties_the_table_and_counters(qtbot, app_window):
    w = app_window
    qtbot.waitUntil(lambda: w.monitor.model.rowCount() >= 1, timeout=10000)
    n = w.monitor.model.rowCount()
    w.monitor.purge_actions["all"].trigger()
    assert f"Drop {n} parked conversation" in w.purger.box.text()
    w.purger.box.button(QMessageBox.StandardButton.Yes).click()
    qtbot.waitUntil(lambda: w.purger.last is not None, timeout=10000)
    assert "Purged all: dropped" in w.statusBar().currentMessage()
    qtbot.waitUntil(lambda: w.monitor.model.rowCount() == 0, timeout=10000)
    qtbot.waitUntil(lambda: cache(w).bytes_ram == 0, timeout=10000)
    assert w.monitor.counters.ram_bar.value() == 0


def test_purge_everything_says_the_slots_conversation_stays_and_it_does(qtbot, app_window):
    w = app_window
    chat(w, CONV_A)
    chat(w, CONV_B)  # A parked, B in the only slot
    qtbot.waitUntil(lambda: w.monitor.model.rowCount() >= 1, timeout=10000)
    stays = "The conversation in the engine's slot now is not parked and stays until it is switched out."
    w.monitor.purge_actions["all"].trigger()
    assert w.purger.box.text().endswith(stays)
    w.purger.box.button(QMessageBox.StandardButton.Yes).click()
    qtbot.waitUntil(lambda: stays in w.statusBar().currentMessage(), timeout=10000)
    assert w.statusBar().currentMessage().startswith("Purged all: dropped ")
    kept = chat(w, CONV_B).usage.prompt_tokens_details.cached_tokens
    gone = chat(w, CONV_A).usage.prompt_tokens_details.cached_tokens
    assert kept > 100 and gone < kept // 4, (kept, gone)  # B was kept by its slot, A was purged


def test_storage_mode_change_in_settings_reaches_the_engine(qtbot, app_window):
    w = app_window
    tab = w.settings_tab
    w.tabs.setCurrentWidget(tab)
    pid = w.engine.pid
    tab.set_text("conversation_cache_storage", "tiered")  # a choice is whole: applied with no Apply click
    qtbot.waitUntil(lambda: "Applied to the running engine: Storage mode = tiered" in tab.result.text(),
                    timeout=30000)
    w.tabs.setCurrentWidget(w.monitor)
    qtbot.waitUntil(lambda: cache(w).storage == "tiered", timeout=10000)
    assert w.monitor.counters.labels["storage"].text().startswith("tiered")
    assert w.engine.pid == pid, "applied live, no restart"
    qtbot.waitUntil(lambda: w.paths.settings_file.exists(), timeout=5000)  # autosaved, debounced
    assert json.loads(w.paths.settings_file.read_text())["engine"]["conversation_cache_storage"] == "tiered"


def test_a_typed_live_budget_applies_on_enter_and_a_restart_setting_offers_restart(qtbot, app_window):
    w = app_window
    tab = w.settings_tab
    w.tabs.setCurrentWidget(tab)
    pid = w.engine.pid
    editor = tab.rows["conversation_cache_slots"].editor
    editor.setFocus()
    editor.selectAll()
    QTest.keyClicks(editor, "48")
    qtbot.wait(1500)  # a pause stores it, but never applies a half-typed number
    assert w.engine.config.conversation_cache_slots != 48, "nothing is sent while typing, nor on a pause"
    QTest.keyClick(editor, Qt.Key.Key_Return)  # Enter: valid, live -> sent without a click
    qtbot.waitUntil(lambda: "Applied to the running engine: Most conversations = 48" in tab.result.text(),
                    timeout=30000)
    http = httpx.get(w.engine.url + "/cache/config", timeout=10).json()
    assert http["settings"]["conversation_cache_slots"] == 48, "the running engine took it"
    assert tab.pending.text() == "The running engine uses these settings." and tab.apply_button.isHidden()
    editor.selectAll()
    QTest.keyClicks(editor, "4x")  # refused: never stored, never sent
    qtbot.waitUntil(lambda: bool(tab.rows["conversation_cache_slots"].error), timeout=5000)
    qtbot.wait(1500)  # past the settle pause
    assert httpx.get(w.engine.url + "/cache/config", timeout=10).json()["settings"]["conversation_cache_slots"] == 48
    tab.set_text("conversation_cache_slots", "48")
    tab.set_text("ctx_size", "4096")  # not live: said, and Restart offered, never done by itself
    assert "need a restart: Context length" in tab.pending.text() and not tab.restart_button.isHidden()
    qtbot.wait(1500)
    assert w.engine.pid == pid and w.engine.state is EngineState.READY
    tab.revert_button.click()  # back to what the engine runs
    assert tab.pending.text() == "The running engine uses these settings." and tab.restart_button.isHidden()
    assert tab.rows["ctx_size"].text() == str(w.engine.config.ctx_size)
    assert "another client" not in tab.result.text(), "the engine's own answers are no change from outside"


SOAK_POLLS = 300  # /metrics answers drawn: a minute at the 200 ms refresh on a quiet machine, longer on a busy one
SOAK_CHATS = 6


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_monitor_soak_60_seconds_live(qtbot, app_window):
    """The Monitor live for SOAK_POLLS answered polls in one process, at a fast refresh, while a client keeps
    the engine generating (a crash here fails the run). Driven by events, not by the clock: a busy machine
    takes longer and still passes.
    """
    import threading

    w = app_window
    w.tabs.setCurrentWidget(w.monitor)
    w.poller.set_interval(200)
    answered: list[dict] = []
    w.poller.metrics.connect(answered.append)
    chats: list[object] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def traffic() -> None:  # off the GUI thread: the Monitor keeps polling while the engine generates
        i = 0
        while not stop.is_set():
            try:
                chats.append(chat(w, CONV_A if i % 2 == 0 else CONV_B))
            except BaseException as e:  # noqa: BLE001 - reported by the test below
                errors.append(e)
                return
            i += 1

    samples_before = len(w.monitor.memory.host_available)
    client = threading.Thread(target=traffic, name="soak-traffic", daemon=True)
    client.start()
    try:
        qtbot.waitUntil(lambda: (len(answered) >= SOAK_POLLS and len(chats) >= SOAK_CHATS) or bool(errors)
                        or w.engine.state is not EngineState.READY, timeout=1_500_000)
    finally:
        stop.set()
        w.poller.metrics.disconnect(answered.append)
        w.poller.set_interval(1000)
    client.join(timeout=180)
    assert not client.is_alive(), "the client's last request finished"
    assert errors == [], f"a request failed during the soak: {errors[:1]}"
    assert w.engine.state is EngineState.READY, "\n".join(list(w.engine.lines)[-20:])
    assert len(answered) >= SOAK_POLLS and len(chats) >= SOAK_CHATS
    # Every answer was drawn: the plots hold a sample per poll and the curves show all of them.
    memory = w.monitor.memory
    assert len(memory.host_available) - samples_before >= SOAK_POLLS // 2, "memory sampled alongside the polls"
    qtbot.waitUntil(lambda: len(memory.host_curve.xData) == len(memory.host_available), timeout=10000)
    assert memory.host_curve.xData[-1] == memory.host_available.data()[0][-1], "the newest sample is drawn"
    from desktop.monitor.report import format_count

    assert w.monitor.counters.labels["requests"].text() == format_count(w.metrics.engine.requests)
    assert w.metrics.engine.requests >= SOAK_CHATS, "the counters show the latest answer"


def test_stop_and_the_app_state_follows(qtbot, app_window):
    w = app_window
    pid = w.engine.pid
    w.stop_button.click()
    qtbot.waitUntil(lambda: w.engine.state is EngineState.STOPPED, timeout=30000)
    assert gone(pid)
    assert w.engine.outcome.requested and not w.engine.outcome.signalled, (
        "the engine should exit by itself after POST /shutdown:\n" + "\n".join(list(w.engine.lines)[-30:]))
    assert "The engine is stopped." in w.monitor.banner.text() and not w.monitor.table.isEnabled()
    assert w.crash_panel.isHidden() and w.start_button.isEnabled()
    assert w.tray.engine_action.text() == "Start engine"


def test_crash_is_shown_within_two_seconds_and_restart_brings_it_back(qtbot, app_window):
    w = app_window
    w.start_button.click()
    qtbot.waitUntil(lambda: w.engine.state is EngineState.READY, timeout=LOAD_TIMEOUT_MS)
    os.kill(w.engine.pid, signal.SIGKILL)
    t0 = time.monotonic()
    qtbot.waitUntil(lambda: not w.crash_panel.isHidden(), timeout=2000)
    assert time.monotonic() - t0 < 2
    assert "killed by SIGKILL" in w.crash_text.text() and "Crashed" in w.state_label.text()
    w.crash_restart.click()
    qtbot.waitUntil(lambda: w.engine.state is EngineState.READY, timeout=LOAD_TIMEOUT_MS)
    # Restarted with the saved settings (tiered after the Settings test; whatever the file says when run alone).
    default = EngineConfig().conversation_cache_storage
    file = w.paths.settings_file
    saved = json.loads(file.read_text())["engine"].get("conversation_cache_storage", default) if file.exists() else default
    qtbot.waitUntil(lambda: cache(w).storage == saved, timeout=10000)


def test_quit_leaves_no_engine_process(qtbot, app_window):
    w = app_window
    pid = w.engine.pid
    assert pid and not gone(pid)
    with qtbot.waitSignal(w.quit_finished, timeout=60000):
        w.tray.quit_action.trigger()
    assert gone(pid)
    assert not w.paths.pid_file.exists()
    assert [p.pid for p in psutil.Process().children(recursive=True) if p.pid == pid] == []


def test_stale_pid_file_from_a_killed_app_is_cleaned_up_at_next_start(qtbot, tmp_path):
    cfg, state = tmp_path / "cfg", tmp_path / "state"
    cfg.mkdir()
    (cfg / "desktop-settings.json").write_text(json.dumps({"schema": 1, "engine": {"port": 0}}))
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "PYTHONPATH": str(REPO)}
    app = subprocess.Popen([sys.executable, "-m", "desktop", "--config-dir", str(cfg), "--state-dir", str(state)],
                           env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pid_file = state / "engine.pid"
    try:
        deadline = time.monotonic() + LOAD_TIMEOUT_MS / 1000
        while time.monotonic() < deadline and not (read_pid_file(pid_file) or {}).get("url"):
            time.sleep(0.2)
        record = read_pid_file(pid_file)
        assert record and record["url"], "the app started an engine and recorded it"
        engine_pid = record["pid"]
        app.send_signal(signal.SIGKILL)  # the app dies without stopping its engine or removing its pid file
        app.wait(timeout=10)
        assert pid_file.exists(), "a stale pid file is left behind"
        # The engine may still be running (an orphan) or be shutting itself down (its stdin closed): either way
        # the next start must leave no engine of the earlier session and no stale pid file.
        w = MainWindow(Paths(cfg, state), use_tray=False, environ={})
        w.store.prefs.start_engine = False
        qtbot.addWidget(w)
        try:
            w.start()
            qtbot.waitUntil(lambda: not pid_file.exists(), timeout=30000)
            qtbot.waitUntil(lambda: gone(engine_pid), timeout=30000)
        finally:
            w.shutdown_now()
    finally:
        if app.poll() is None:
            app.kill()
        record = read_pid_file(pid_file)
        if record and not gone(record["pid"]):
            os.kill(record["pid"], signal.SIGKILL)
