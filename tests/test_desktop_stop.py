"""The app stops a real engine (the bundled model, tiered storage) through the engine's own clean shutdown, however
it is asked to: the live slot is parked and spilled to disk, the engine exits 0, and the app never kills it.

- The app asks an engine that is stopping already (its POST /shutdown cannot connect): it waits for the exit
  the engine began; it used to terminate it, which on Windows is TerminateProcess in the middle of the spill.
- The app process (under a virtual X screen) is asked to end: by SIGTERM, as a desktop session ends it, or by a
  close request to a window of it nobody can see, the X11 counterpart of the WM_CLOSE that Windows' taskkill
  (without /F) and uninstallers post to every window of the process: the same quit as tray → Quit.

And with the stand-in engine, in this process: a hidden main window asked to close quits (it no longer hides to
the tray), a quit request from Qt or the platform waits for that quit, and the teardown at exit (aboutToQuit,
which Windows sends alone when the session ends) stops the engine cleanly instead of killing it.
"""

from __future__ import annotations

import os

os.environ["QT_QPA_PLATFORM"] = "offscreen"

import json
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import psutil
import pytest
from PySide6.QtGui import QCloseEvent
from PySide6.QtWidgets import QApplication

from desktop import main_window
from desktop.client import Dispatcher, EngineClient
from desktop.engine_process import EngineProcess, EngineState, ProcessOutcome
from desktop.main_window import MainWindow
from desktop.pid_file import read_pid_file
from desktop.quit_requests import CloseSentinel
from desktop.settings import Paths
from engine.config import EngineConfig
from tests.test_desktop_support import fake_engine_command, wait_ready

pytestmark = pytest.mark.timeout(240)
REPO = Path(__file__).resolve().parents[1]
LOAD_TIMEOUT_S = 120
ABOUT_RIVERS = [{"role": "user", "content": "Tell me about rivers and bridges. " * 20}]


def chat(url: str) -> None:
    """One turn: the slot then holds a conversation worth parking at shutdown."""
    reply = httpx.post(url + "/v1/chat/completions", timeout=60, trust_env=False,
                       json={"model": "x", "messages": ABOUT_RIVERS, "max_tokens": 4, "temperature": 0})
    assert reply.status_code == 200, reply.text


def spilled(folder: Path) -> list[str]:
    """The conversation files written to the cache folder (one subfolder per model)."""
    return [name for _, _, files in os.walk(folder) for name in files if name.startswith("conv-")]


def refused(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=2, trust_env=False)
    except httpx.ConnectError:
        return True
    except httpx.HTTPError:
        pass
    return False


@pytest.fixture
def supervisor(qtbot):
    dispatcher = Dispatcher()
    client = EngineClient(dispatcher)
    proc = EngineProcess(client)
    yield proc
    proc.kill_and_wait()
    proc.close()
    dispatcher.close()
    client.close()


def test_an_engine_stopping_already_is_waited_for_not_terminated(qtbot, supervisor, tmp_path):
    supervisor.start(EngineConfig(port=0, ctx_size=2048, conversation_cache_storage="tiered",
                                  conversation_cache_dir=str(tmp_path)))
    qtbot.waitUntil(lambda: supervisor.state is EngineState.READY, timeout=LOAD_TIMEOUT_S * 1000)
    url = supervisor.url
    chat(url)
    # Something else stopped it first (its stdin closing does the same): it no longer listens, and is still
    # parking and spilling when the app asks.
    assert httpx.post(url + "/shutdown", timeout=10, trust_env=False).status_code == 202
    qtbot.waitUntil(lambda: refused(url), timeout=10000)
    assert supervisor.running, "the engine ended before the app asked; nothing was tested"
    with qtbot.waitSignal(supervisor.ended, timeout=60000) as blocker:
        supervisor.stop()
    outcome: ProcessOutcome = blocker.args[0]
    lines = "\n".join(supervisor.lines)
    assert outcome.exit_code == 0 and not outcome.signalled and outcome.requested, lines
    assert "terminating" not in lines and "killing" not in lines, lines
    assert "/shutdown failed" in lines and "waiting for it to exit" in lines, lines
    assert "parked" in lines and "engine stopped" in lines, lines
    assert spilled(tmp_path), "the tiered cache spilled its conversation to disk"


# Asks X windows (their ids in argv) to close as a window manager does: a WM_PROTOCOLS client message naming
# WM_DELETE_WINDOW. Run with the display's DISPLAY and XAUTHORITY, in a process of its own.
CLOSE_REQUEST = textwrap.dedent("""
    import ctypes, ctypes.util, os, sys

    class ClientMessage(ctypes.Structure):  # Xlib's XClientMessageEvent
        _fields_ = [("type", ctypes.c_int), ("serial", ctypes.c_ulong), ("send_event", ctypes.c_int),
                    ("display", ctypes.c_void_p), ("window", ctypes.c_ulong), ("message_type", ctypes.c_ulong),
                    ("format", ctypes.c_int), ("data", ctypes.c_long * 5)]

    x11 = ctypes.CDLL(ctypes.util.find_library("X11"))
    x11.XOpenDisplay.restype = ctypes.c_void_p
    x11.XOpenDisplay.argtypes = [ctypes.c_char_p]
    x11.XInternAtom.restype = ctypes.c_ulong
    x11.XInternAtom.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
    x11.XSendEvent.argtypes = [ctypes.c_void_p, ctypes.c_ulong, ctypes.c_int, ctypes.c_long, ctypes.c_void_p]
    x11.XFlush.argtypes = x11.XCloseDisplay.argtypes = [ctypes.c_void_p]
    display = x11.XOpenDisplay(os.environ["DISPLAY"].encode())
    assert display, "cannot open the display"
    for window in map(int, sys.argv[1:]):
        event = ClientMessage(type=33, window=window, format=32,  # 33: ClientMessage
                              message_type=x11.XInternAtom(display, b"WM_PROTOCOLS", 0))
        event.data[0] = x11.XInternAtom(display, b"WM_DELETE_WINDOW", 0)
        whole = ctypes.create_string_buffer(192)  # an XEvent is a union of 24 longs
        ctypes.memmove(whole, ctypes.byref(event), ctypes.sizeof(event))
        x11.XSendEvent(display, window, 0, 0, whole)
    x11.XFlush(display)
    x11.XCloseDisplay(display)
""")


def unseen_windows(env: dict[str, str], title: str) -> list[int]:
    """The X windows named `title` that are not shown."""
    def search(*flags: str) -> set[int]:
        out = subprocess.run(["xdotool", "search", *flags, "--name", f"^{title}$"], env=env, capture_output=True,
                             text=True, timeout=10).stdout
        return {int(w) for w in out.split()}

    return sorted(search() - search("--onlyvisible"))


def display_of(pid: int) -> dict[str, str]:
    """An environment with the DISPLAY and XAUTHORITY of a process (xvfb-run picks both for its child)."""
    environ = psutil.Process(pid).environ()
    return {**os.environ, **{k: environ[k] for k in ("DISPLAY", "XAUTHORITY") if k in environ}}


def ask_by_close_request(app_pid: int) -> None:
    env = display_of(app_pid)
    windows = unseen_windows(env, "Strata Desktop")
    assert windows, "the app has a window nobody sees, for the system's close requests"
    subprocess.run([sys.executable, "-c", CLOSE_REQUEST, *map(str, windows)], env=env, check=True, timeout=30)


def ask_by_sigterm(app_pid: int) -> None:
    os.kill(app_pid, signal.SIGTERM)


@pytest.mark.skipif(not (shutil.which("xvfb-run") and shutil.which("xdotool")),
                    reason="needs xvfb-run and xdotool (scripts/setup.sh installs them)")
@pytest.mark.parametrize("ask", [ask_by_sigterm, ask_by_close_request], ids=["sigterm", "close-request"])
def test_the_app_asked_to_end_stops_its_engine_cleanly(tmp_path, ask):
    cfg, state, parked = tmp_path / "cfg", tmp_path / "state", tmp_path / "parked"
    cfg.mkdir()
    engine = {"port": 0, "ctx_size": 2048, "conversation_cache_storage": "tiered",
              "conversation_cache_dir": str(parked)}
    (cfg / "desktop-settings.json").write_text(json.dumps({"schema": 1, "engine": engine}))
    env = {k: v for k, v in os.environ.items() if k not in ("QT_QPA_PLATFORM", "DISPLAY")}
    env["PYTHONPATH"] = str(REPO)
    run = subprocess.Popen(["xvfb-run", "-a", "-s", "-screen 0 1280x800x24", sys.executable, "-m", "desktop",
                            "--config-dir", str(cfg), "--state-dir", str(state)],
                           env=env, cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    record: dict | None = None
    try:
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while time.monotonic() < deadline and run.poll() is None and not (record or {}).get("url"):
            time.sleep(0.2)
            record = read_pid_file(state / "engine.pid")
        assert record and record.get("url"), "the app started an engine and recorded it"
        url = record["url"]
        while httpx.get(url + "/health", timeout=5, trust_env=False).status_code != 200:
            assert time.monotonic() < deadline, "the engine did not become ready"
            time.sleep(0.2)
        chat(url)
        ask(record["app_pid"])
        assert run.wait(timeout=60) == 0, run.stdout.read() if run.stdout else ""
        assert not psutil.pid_exists(record["pid"]), "the engine outlived the app"
    finally:
        if run.poll() is None:
            run.kill()
        if record and psutil.pid_exists(record["pid"]):
            os.kill(record["pid"], signal.SIGKILL)
    engine_log = (state / "logs" / "engine.log").read_text(encoding="utf-8")
    desktop_log = (state / "logs" / "desktop.log").read_text(encoding="utf-8")
    assert "shutdown requested" in engine_log and "engine stopped" in engine_log, engine_log
    assert "parked" in engine_log, engine_log
    assert "the engine exited normally" in desktop_log, desktop_log
    assert "terminating" not in desktop_log and "killing" not in desktop_log, desktop_log
    assert spilled(parked), "the tiered cache spilled its conversation to disk"


# ---------------------------------------------------------------------------------------------- with the stand-in


@pytest.fixture
def tray_window(qtbot, tmp_path, monkeypatch):
    """A main window that closes to the tray (as if the desktop had one), its engine the stand-in, serving."""
    monkeypatch.setattr(main_window, "tray_available", lambda: True)
    w = MainWindow(Paths(tmp_path / "cfg", tmp_path / "state"), use_tray=True, environ={})
    w.engine.command_for = fake_engine_command()
    w.store.set("port", 0)
    w.store.set_pref("close_to_tray", True)
    qtbot.addWidget(w)
    w.show()
    w.start()
    wait_ready(qtbot, w)
    ended: list[ProcessOutcome] = []
    w.engine.ended.connect(ended.append)
    w.ended = ended
    yield w
    w.shutdown_now()


def test_a_hidden_window_asked_to_close_quits_with_the_clean_stop(qtbot, tray_window):
    w = tray_window
    w.close()  # a person's click on the close button: to the tray, serving
    assert not w.isVisible() and w.engine.state is EngineState.READY
    with qtbot.waitSignal(w.quit_finished, timeout=10000):
        QApplication.sendEvent(w, QCloseEvent())  # nobody can click a hidden window: the system asks the app to end
    assert w.ended and w.ended[0].exit_code == 0 and not w.ended[0].signalled, w.ended
    assert not any("killing" in line for line in w.engine.lines)


def test_teardown_at_exit_stops_the_engine_cleanly(tray_window):
    tray_window.shutdown_now()  # what aboutToQuit runs
    ended = tray_window.ended
    assert ended and ended[0].exit_code == 0 and not ended[0].signalled, ended
    assert not any("killing" in line for line in tray_window.engine.lines)


def test_a_quit_while_a_restart_stops_the_old_engine_starts_no_new_one(qtbot, tray_window):
    w = tray_window
    pid = w.engine.pid
    w.restart_engine()  # the old engine stopping; the new one would start when it has ended
    assert w.engine.state is EngineState.STOPPING
    with qtbot.waitSignal(w.quit_finished, timeout=20000):
        w.quit()
    qtbot.wait(500)  # what the old engine's end would have started, had the restart stayed under way
    assert not w.engine.running and w.engine.pid in (None, pid), list(w.engine.lines)[-5:]
    assert sum("strata-desktop: starting" in line for line in w.engine.lines) <= 1, list(w.engine.lines)


def test_a_window_nobody_sees_takes_close_requests_for_the_app(qtbot):
    asked: list[int] = []
    sentinel = CloseSentinel(lambda: asked.append(1))
    assert not sentinel.isVisible()
    for _ in range(2):  # refused each time: the window stays, so a later request reaches it too
        event = QCloseEvent()
        QApplication.sendEvent(sentinel, event)
        assert not event.isAccepted()
    assert asked == [1, 1] and not sentinel.isVisible()
    sentinel.destroy()


QUIT_REQUESTS = textwrap.dedent("""
    import json
    from PySide6.QtCore import QTimer
    from desktop.quit_requests import Application

    app = Application(["strata-desktop"])
    asked, finished = [], []

    def clean_quit():
        finished.append(1)
        app.quit()

    def handler():
        asked.append(1)
        if not finished:
            QTimer.singleShot(200, clean_quit)  # the quit under way ends the loop itself
        return bool(finished)

    app.route_quits(handler)
    QTimer.singleShot(0, app.quit)  # as Qt or the platform asks
    QTimer.singleShot(10000, lambda: app.exit(3))
    print("RESULT " + json.dumps({"rc": app.exec(), "asked": len(asked), "finished": len(finished)}))
""")


def test_a_quit_request_from_qt_waits_for_the_clean_quit():
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", QUIT_REQUESTS], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, out.stdout + out.stderr
    assert json.loads(lines[-1][len("RESULT "):]) == {"rc": 0, "asked": 2, "finished": 1}
