"""The real tray under a virtual X screen with a tray host (trayer): shown, close-to-tray, click to open, quit."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not (shutil.which("xvfb-run") and shutil.which("trayer") and shutil.which("xdotool")),
                       reason="needs xvfb-run, trayer and xdotool (scripts/setup.sh installs them)"),
]

SCRIPT = textwrap.dedent("""
    import json, os, subprocess, sys, time
    from pathlib import Path
    os.environ.pop("QT_QPA_PLATFORM", None)
    from PySide6.QtWidgets import QApplication, QSystemTrayIcon
    from PySide6.QtCore import QEventLoop
    app = QApplication(["strata-desktop"])
    app.setQuitOnLastWindowClosed(False)
    out = {"platform": app.platformName(), "tray_before_host": QSystemTrayIcon.isSystemTrayAvailable()}

    def pump(cond, timeout):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            app.processEvents(QEventLoop.ProcessEventsFlag.AllEvents, 50)
            if cond():
                return True
            time.sleep(0.02)
        return False

    trayer = subprocess.Popen(["trayer", "--edge", "bottom", "--align", "right", "--widthtype", "pixel",
                               "--width", "200", "--height", "32"])
    try:
        out["tray_available"] = pump(QSystemTrayIcon.isSystemTrayAvailable, 10)
        from desktop.engine_process import EngineState
        from desktop.main_window import MainWindow
        from desktop.settings import Paths
        from tests.test_desktop_support import fake_engine_command
        base = Path(sys.argv[1])
        w = MainWindow(Paths(base / "cfg", base / "state"), environ={})
        w.engine.command_for = fake_engine_command()
        w.store.set("port", 0)
        out["use_tray"] = w.use_tray
        w.show()
        w.start()
        out["ready"] = pump(lambda: w.engine.state is EngineState.READY, 20)
        pump(lambda: "parked" in w.tray.icon.toolTip(), 10)
        out["tooltip"] = w.tray.icon.toolTip()
        out["icon_visible"] = pump(lambda: w.tray.icon.isVisible() and not w.tray.icon.geometry().isEmpty(), 10)
        g = w.tray.icon.geometry()
        out["icon_geometry"] = [g.x(), g.y(), g.width(), g.height()]
        w.close()
        pump(lambda: False, 0.5)
        out["hidden_after_close"] = not w.isVisible()
        out["engine_after_close"] = w.engine.state.value
        out["notice_shown_pref"] = w.store.prefs.tray_notice_shown
        pump(lambda: False, 0.5)
        cx, cy = g.x() + g.width() // 2, g.y() + g.height() // 2
        subprocess.run(["xdotool", "mousemove", str(cx), str(cy), "click", "1"], check=True)
        out["shown_after_click"] = pump(w.isVisible, 5)
        pump(lambda: False, 1.0)
        w.screen().grabWindow(0).save(str(base / "screen.png"))
        done = []
        w.quit_finished.connect(lambda: done.append(1))
        w.tray.quit_action.trigger()
        out["quit"] = pump(lambda: bool(done), 20)
        out["engine_after_quit"] = w.engine.state.value
    finally:
        trayer.terminate()
        trayer.wait(5)
    print("RESULT " + json.dumps(out), flush=True)
""")


def test_real_tray_under_xvfb(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("QT_QPA_PLATFORM", "DISPLAY")}
    env["PYTHONPATH"] = str(REPO)
    script = tmp_path / "tray_check.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(["xvfb-run", "-a", "-s", "-screen 0 1280x800x24", sys.executable, str(script), str(tmp_path)],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=100)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["platform"] == "xcb"
    assert out["tray_before_host"] is False and out["tray_available"] is True
    assert out["use_tray"] and out["ready"] and out["icon_visible"], out
    assert out["tooltip"].startswith("Strata — Ready · 2 parked"), out
    assert out["hidden_after_close"] and out["engine_after_close"] == "ready", "closing keeps serving from the tray"
    assert out["notice_shown_pref"] is True
    assert out["shown_after_click"], out
    assert out["quit"] and out["engine_after_quit"] == "stopped", out
    assert (tmp_path / "screen.png").stat().st_size > 0
