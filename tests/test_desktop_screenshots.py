"""Screenshots of the Monitor, Settings and Chat tabs with the real engine serving, taken under Xvfb.

Skipped unless STRATA_UPDATE_SCREENSHOTS=1: it rewrites docs/screenshots/monitor.png, settings.png and chat.png.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(os.environ.get("STRATA_UPDATE_SCREENSHOTS") != "1",
                       reason="set STRATA_UPDATE_SCREENSHOTS=1 to rewrite docs/screenshots"),
    pytest.mark.skipif(not shutil.which("xvfb-run"), reason="needs xvfb-run"),
]

SCRIPT = textwrap.dedent("""
    import os, sys, threading, time
    from pathlib import Path
    os.environ.pop("QT_QPA_PLATFORM", None)
    from PySide6.QtCore import QEventLoop
    from PySide6.QtWidgets import QApplication, QScrollArea
    app = QApplication(["strata-desktop"])
    from desktop.engine_process import EngineState
    from desktop.main_window import MainWindow
    from desktop.settings import Paths
    import openai

    base, out = Path(sys.argv[1]), Path(sys.argv[2])

    def pump(seconds, cond=lambda: False):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            app.processEvents(QEventLoop.ProcessEventsFlag.AllEvents, 50)
            if cond():
                return True
            time.sleep(0.02)
        return False

    w = MainWindow(Paths(base / "cfg", base / "state"), use_tray=False, environ={})
    import socket
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    free_port = probe.getsockname()[1]  # a real port number: port 0 would show its warning in the picture
    probe.close()
    for name, value in (("port", free_port), ("conversation_cache_storage", "tiered"), ("conversation_cache_mib", 32),
                        ("conversation_cache_disk_mib", 1024), ("conversation_cache_dir", str(base / "parked"))):
        w.store.set(name, value)
    w.resize(1280, 860)
    w.show()
    w.start()
    assert pump(180, lambda: w.engine.state is EngineState.READY), "engine not ready"
    client = openai.OpenAI(base_url=w.engine.url + "/v1", api_key="unused", timeout=120)
    topics = ["apples", "rivers", "bridges", "volcanoes", "violins"]
    convs = [[{"role": "system", "content": f"You are an expert on {t}. Answer briefly. " * 12},
              {"role": "user", "content": f"Tell me three facts about {t}. " * 8}] for t in topics]
    order = [0, 1, 2, 0, 3, 1, 4, 0, 2, 3, 0, 1]

    def traffic():
        for i in order:
            client.chat.completions.create(model="default", messages=convs[i], max_tokens=6, temperature=0)
            time.sleep(3)

    t = threading.Thread(target=traffic)
    t.start()
    while t.is_alive():
        pump(0.5)
    pump(6)
    w.tabs.setCurrentWidget(w.monitor)
    pump(2)
    w.grab().save(str(out / "monitor.png"))
    tab = w.settings_tab
    w.tabs.setCurrentWidget(tab)
    tab.set_text("ctx_size", "4096")
    scroll = tab.findChild(QScrollArea)
    group = tab.rows["conversation_cache_storage"].container.parentWidget()
    scroll.verticalScrollBar().setValue(group.y() - 4)
    pump(2)
    w.grab().save(str(out / "settings.png"))
    chat = w.chat
    w.tabs.setCurrentWidget(chat)
    answered = []
    chat.turn_finished.connect(answered.append)

    def say(text):
        n = len(answered)
        chat.max_tokens.setValue(40)
        chat.input.setText(text)
        chat.send()
        assert pump(180, lambda: len(answered) > n), "no answer in the Chat tab"

    say("Why do apples turn brown after they are cut? Explain it simply for a child.")
    chat.new_button.click()
    say("Name three long rivers in Europe.")  # the one slot goes to this one: the apple conversation is parked
    chat.pick(0)
    say("And why does lemon juice stop it?")  # restored: most of its prompt comes back cached
    pump(2)
    w.grab().save(str(out / "chat.png"))
    w.shutdown_now()
    print("SCREENSHOTS OK", flush=True)
""")


def test_update_screenshots(tmp_path):
    out = REPO / "docs" / "screenshots"
    out.mkdir(parents=True, exist_ok=True)
    script = tmp_path / "shots.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("QT_QPA_PLATFORM", "DISPLAY")}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run(["xvfb-run", "-a", "-s", "-screen 0 1280x900x24", sys.executable, str(script),
                           str(tmp_path), str(out)], env=env, cwd=REPO, capture_output=True, text=True, timeout=580)
    assert "SCREENSHOTS OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in ("monitor.png", "settings.png", "chat.png"):
        assert (out / name).stat().st_size > 10_000
