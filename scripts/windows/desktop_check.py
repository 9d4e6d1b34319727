"""The desktop app's check for scripts/windows-check.sh, run by the Windows CPython under wine on a virtual X screen.

    python desktop_check.py FOLDER

Opens the real main window with its real engine (settings and state in FOLDER), waits until the engine is ready and
the Monitor shows its figures after a chat, asks the Linux side for a screenshot of the screen (FOLDER/shot-now,
answered by FOLDER/shot-done) and saves the window's own picture (FOLDER/window.png), closes the window (it goes
to the tray and keeps serving), then quits from the tray menu, which stops the engine. The last line is
`RESULT {json}`; exits non-zero when a stage failed.
"""

from __future__ import annotations

import json
import socket
import sys
import time
import urllib.request
from pathlib import Path


def main() -> int:
    base = Path(sys.argv[1])
    from PySide6.QtCore import QEventLoop
    from PySide6.QtWidgets import QApplication, QSystemTrayIcon

    app = QApplication(["strata-desktop"])
    app.setApplicationName("Strata Desktop")
    app.setQuitOnLastWindowClosed(False)
    out: dict[str, object] = {"platform": app.platformName(), "tray": QSystemTrayIcon.isSystemTrayAvailable()}

    def pump(cond, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            app.processEvents(QEventLoop.ProcessEventsFlag.AllEvents, 50)
            if cond():
                return True
            time.sleep(0.02)
        return False

    from desktop.engine_process import EngineState
    from desktop.main_window import MainWindow
    from desktop.settings import Paths

    with socket.socket() as s:  # a free port for the engine (the default 8080 may be taken on a shared machine)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    w = MainWindow(Paths(base / "cfg", base / "state"), environ={})
    w.store.set("port", port)
    metrics: list = []  # engine.contract.MetricsBody, as the poller parses GET /metrics for the Monitor
    w.poller.metrics.connect(metrics.append)
    w.show()
    w.start()
    out["window"] = pump(w.isVisible, 30)
    out["ready"] = pump(lambda: w.engine.state is EngineState.READY, 600)
    if out["ready"]:
        body = json.dumps({"model": "local", "max_tokens": 8,
                           "messages": [{"role": "user", "content": "Say hello."}]}).encode()
        req = urllib.request.Request(f"{w.engine.url}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as response:
            out["chat"] = json.loads(response.read())["choices"][0]["message"]["content"][:40]
        # The Monitor has filled in once a poll after the chat counts it.
        out["monitor"] = pump(lambda: any(m.engine.requests >= 1 for m in metrics), 60)
        pump(lambda: False, 2.0)  # let the plots draw
    w.grab().save(str(base / "window.png"))
    (base / "shot-now").touch()
    out["screenshot"] = pump(lambda: (base / "shot-done").exists(), 60)

    w.close()
    pump(lambda: False, 1.0)
    out["hidden_after_close"] = not w.isVisible()
    out["engine_after_close"] = w.engine.state.value
    done: list[int] = []
    w.quit_finished.connect(lambda: done.append(1))
    w.tray.quit_action.trigger()
    out["quit"] = pump(lambda: bool(done), 120)
    out["engine_after_quit"] = w.engine.state.value
    ok = (out["window"] and out["ready"] and out.get("monitor") and out["hidden_after_close"]
          and out["engine_after_close"] == "ready" and out["quit"] and out["engine_after_quit"] == "stopped")
    print("RESULT " + json.dumps(out), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
