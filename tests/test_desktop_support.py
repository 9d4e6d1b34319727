"""Helpers for the desktop tests: a stand-in engine process speaking the engine's HTTP API, and fixtures.

The stand-in is a real child process (run as `python tests/test_desktop_support.py serve ...`) so the
supervisor's mechanics (start, readiness, crash, /shutdown, terminate, kill, pid file) are tested against a
process a user would see, quickly and without torch. The end-to-end tests use the real engine.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

FAKE_ENGINE = Path(__file__).resolve()


def fake_engine_command(*extra: str):
    """A command_for replacement that starts the stand-in with the config's flags plus `extra`."""

    def command(config) -> list[str]:
        return [sys.executable, str(FAKE_ENGINE), "serve", *config.to_args(), *extra]

    return command


def stand_in_window(qtbot, tmp_path):
    """A main window (no tray) whose engine is the stand-in, on a free port; shut down after the test."""
    from desktop.main_window import MainWindow
    from desktop.settings import Paths

    w = MainWindow(Paths(tmp_path / "cfg", tmp_path / "state"), use_tray=False, environ={})
    w.engine.command_for = fake_engine_command()
    w.store.set("port", 0)
    qtbot.addWidget(w)
    w.show()
    yield w
    w.shutdown_now()


def wait_ready(qtbot, w) -> None:
    from desktop.engine_process import EngineState

    qtbot.waitUntil(lambda: w.engine.state is EngineState.READY, timeout=15000)


# ---------------------------------------------------------------------------------------------- the stand-in


class _State:
    def __init__(self, args: dict[str, str]) -> None:
        self.ready_at = time.time() + float(args.get("--ready-after", "0"))
        self.settings = {
            "conversation_cache_storage": args.get("--conversation-cache-storage", "ram"),
            "conversation_cache_mib": int(args.get("--conversation-cache-mib", "4096")),
            "conversation_cache_disk_mib": int(args.get("--conversation-cache-disk-mib", "16384")),
            "conversation_cache_dir": args.get("--conversation-cache-dir", ""),
            "conversation_cache_slots": int(args.get("--conversation-cache-slots", "64")),
            "conversation_cache_min_free_mib": int(args.get("--conversation-cache-min-free-mib", "1024")),
        }
        now = time.time()
        self.conversations = [
            {"id": "conv-a", "tokens": 1200, "bytes": 3_000_000, "tier": "ram", "created": now - 30,
             "last_used": now - 5, "hits": 2},
            {"id": "conv-b", "tokens": 800, "bytes": 2_000_000, "tier": "disk", "created": now - 20,
             "last_used": now - 10, "hits": 0},
        ]
        self.events = [
            {"time": now - 12, "kind": "park", "conversation_id": "conv-a", "tokens": 1200, "bytes": 3_000_000,
             "ms": 4.0, "tier": "ram"},
            {"time": now - 6, "kind": "restore", "conversation_id": "conv-a", "tokens": 1200, "bytes": 3_000_000,
             "ms": 2.0, "tier": "ram"},
        ]
        self.lock = threading.Lock()

    def metrics(self) -> dict:
        with self.lock:
            ram = sum(c["bytes"] for c in self.conversations if c["tier"] == "ram")
            disk = sum(c["bytes"] for c in self.conversations if c["tier"] == "disk")
            s = self.settings
            return {
                "engine": {"model": "stand-in", "state": "ready", "slots": 1, "slots_busy": 0, "queued": 0,
                           "requests": 3, "uptime_s": 12.0, "pid": os.getpid()},
                "conversation_cache": {
                    "enabled": True, "storage": s["conversation_cache_storage"], "dir": "/tmp/x",
                    "budgets": {"ram_bytes": s["conversation_cache_mib"] << 20,
                                "disk_bytes": s["conversation_cache_disk_mib"] << 20,
                                "slots": s["conversation_cache_slots"],
                                "min_free_bytes": s["conversation_cache_min_free_mib"] << 20},
                    "bytes_ram": ram, "bytes_disk": disk, "hits": 2, "misses": 1, "tokens_reused": 2400,
                    "parks": 1, "restores": 1, "park_ms": {"last": 4.0, "p50": 4.0, "p95": 4.0},
                    "restore_ms": {"last": 2.0, "p50": 2.0, "p95": 2.0},
                },
            }


def _make_handler(state: _State, server_ref: list):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt: str, *args) -> None:
            sys.stderr.write("stand-in: " + (fmt % args) + "\n")

        def _send(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> dict:
            n = int(self.headers.get("Content-Length") or 0)
            return json.loads(self.rfile.read(n) or b"{}")

        def do_GET(self) -> None:
            url = urlparse(self.path)
            if url.path == "/health":
                ok = time.time() >= state.ready_at
                self._send(200 if ok else 503, {"status": "ok" if ok else "loading"})
            elif url.path == "/metrics":
                self._send(200, state.metrics())
            elif url.path == "/cache/conversations":
                with state.lock:
                    self._send(200, {"conversations": list(state.conversations)})
            elif url.path == "/cache/events":
                limit = int(parse_qs(url.query).get("limit", ["100"])[0])
                self._send(200, {"events": state.events[-limit:]})
            elif url.path == "/cache/config":
                self._send(200, {"settings": state.settings, "live": sorted(state.settings),
                                 "effective_dir": "/tmp/stand-in-cache"})
            else:
                self._send(404, {"error": {"message": f"no route {url.path}"}})

        def do_PUT(self) -> None:
            if self.path != "/cache/config":
                self._send(404, {"error": {"message": "no route"}})
                return
            body = self._body()
            if body.get("conversation_cache_storage") not in (None, "ram", "disk", "tiered"):
                self._send(400, {"error": {"message": "conversation_cache_storage: expected ram, disk or tiered"}})
                return
            unknown = [k for k in body if k not in state.settings]
            if unknown:
                self._send(400, {"error": {"message": f"not a live setting: {unknown[0]}"}})
                return
            state.settings.update(body)
            self._send(200, {"settings": state.settings, "changed": sorted(body)})

        def do_POST(self) -> None:
            if self.path == "/shutdown":
                self._send(202, {"status": "shutting down"})
                if "--ignore-shutdown" not in sys.argv:
                    threading.Thread(target=lambda: (time.sleep(0.1), os._exit(0)), daemon=True).start()
            elif self.path == "/cache/purge":
                tier = self._body().get("tier", "all")
                with state.lock:
                    gone = [c for c in state.conversations if tier == "all" or c["tier"] == tier]
                    state.conversations = [c for c in state.conversations if c not in gone]
                self._send(200, {"tier": tier, "dropped": {"conversations": len(gone),
                                                           "bytes": sum(c["bytes"] for c in gone)}, "skipped": []})
            else:
                self._send(404, {"error": {"message": "no route"}})

    return Handler


def serve(argv: list[str]) -> None:
    args: dict[str, str] = {}
    for i, a in enumerate(argv):
        if a.startswith("--") and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            args[a] = argv[i + 1]
    if "--ignore-term" in argv:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if "--noisy" in argv:  # long log lines, as a traceback with long paths gives
        for i in range(30):
            print(f"stand-in: noisy line {i} " + "/very/long/path/segment" * 20, file=sys.stderr, flush=True)
    if "--fail-at-start" in argv:
        # The engine's own words for a refused start (engine/cli.py): one error line, status 2.
        print("strata serve: error: cannot load the model: 'missing.gguf': no such file", file=sys.stderr, flush=True)
        sys.exit(2)
    state = _State(args)
    server_ref: list = []
    httpd = ThreadingHTTPServer((args.get("--host", "127.0.0.1"), int(args.get("--port", "0"))),
                                _make_handler(state, server_ref))
    server_ref.append(httpd)
    host, port = httpd.server_address[:2]
    print("stand-in: loading", file=sys.stderr, flush=True)
    print(f"strata: listening on http://{host}:{port}", flush=True)
    httpd.serve_forever()


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    serve(sys.argv[2:])
