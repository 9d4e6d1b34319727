"""Helpers for the desktop tests: a stand-in engine process speaking the engine's HTTP API, and fixtures.

The stand-in is a real child process (run as `python tests/test_desktop_support.py serve ...`) so the
supervisor's mechanics (start, readiness, crash, /shutdown, its stdin closing, kill, pid file) are tested against
a process a user would see, quickly and without torch. The end-to-end tests use the real engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import stat
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

# Run as a script, the stand-in imports the engine's contract from this checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.contract import (  # noqa: E402
    CacheConfigBody,
    ConversationRow,
    ConversationsBody,
    Dropped,
    Event,
    EventsBody,
    HealthBody,
    MetricsBody,
    PurgeBody,
    RequestRecord,
    RequestsBody,
    to_json,
)
from engine.figures import CacheFigures, EngineFigures, Timing  # noqa: E402

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


# ------------------------------------------------------------------------------- bodies handed to widgets directly


def conversation_row(id: str, tier: str = "ram", **fields) -> ConversationRow:  # noqa: A002 - the contract's name
    """A /cache/conversations row as the client hands it on; what a test leaves out is zero (or the default)."""
    return ConversationRow(**{"id": id, "tier": tier, "tokens": 0, "bytes": 0, "created": 0.0, "last_used": 0.0,
                              "hits": 0, **fields})


def metrics_body(engine: dict | None = None, cache: dict | None = None) -> MetricsBody:
    """A /metrics body as the client hands it on: the fields a test gives, the rest as an engine that does not
    measure them reports."""
    return MetricsBody(EngineFigures(**{"model": "", "state": "", **(engine or {})}),
                       CacheFigures(**{"enabled": True, "storage": "ram", **(cache or {})}))


def event(kind: str, **fields) -> Event:
    """A /cache/events entry as the client hands it on."""
    return Event(**{"time": 0.0, "kind": kind, "conversation_id": None, "tokens": 0, "bytes": 0, "ms": 0.0,
                    "tier": "ram", **fields})


def request_record(reason: str, **fields) -> RequestRecord:
    """A /cache/requests record as the client hands it on."""
    return RequestRecord(**{"time": 0.0, "request_id": "r", "conversation_id": None, "name": "", "client": "",
                            "priority": "normal", "prompt_tokens": 0, "reused_tokens": 0, "source": "none",
                            "reason": reason, **fields})


# ---------------------------------------------------------------------------------------------- the stand-in


class _State:
    """What the stand-in serves; every body is built from the engine's contract types (engine/contract.py)."""

    def __init__(self, args: dict[str, str]) -> None:
        from engine.config import LIVE_SETTINGS, EngineConfig, setting_of

        self.args = args
        self.started = time.time()
        self.ready_at = self.started + float(args.get("--ready-after", "0"))
        defaults = EngineConfig()
        # Every live setting, from its flag (or the default), parsed as the engine parses it.
        self.settings = {
            name: setting_of(name).parse(args.get(setting_of(name).flag, getattr(defaults, name)))
            for name in LIVE_SETTINGS
        }
        now = time.time()
        self.conversations = [
            ConversationRow(id="conv-a", tokens=1200, bytes=3_000_000, tier="ram", created=now - 30,
                            last_used=now - 5, hits=2),
            ConversationRow(id="conv-b", tokens=800, bytes=2_000_000, tier="disk", created=now - 20,
                            last_used=now - 10, hits=0, on_disk=True),
        ]
        self.events = [
            Event(time=now - 12, kind="park", conversation_id="conv-a", tokens=1200, bytes=3_000_000, ms=4.0,
                  tier="ram"),
            Event(time=now - 6, kind="restore", conversation_id="conv-a", tokens=1200, bytes=3_000_000, ms=2.0,
                  tier="ram"),
        ]
        # Requests explained (GET /cache/requests): conv-a came back from RAM, conv-b was evicted.
        self.requests = [
            RequestRecord(time=now - 14, request_id="cmpl-1", conversation_id="conv-a", name="Fix the parser",
                          client="OpenAI/Python", priority="normal", prompt_tokens=1000, reused_tokens=0,
                          source="none", reason="cold", detail={"computed": 1000}, ttft_ms=900.0),
            RequestRecord(time=now - 6, request_id="cmpl-2", conversation_id="conv-a", name="Fix the parser",
                          client="OpenAI/Python", priority="normal", prompt_tokens=1200, reused_tokens=1000,
                          source="ram", reason="new_tokens", detail={"computed": 200}, ttft_ms=120.0,
                          spec_drafted=40, spec_accepted=30),
            RequestRecord(time=now - 3, request_id="cmpl-3", conversation_id="conv-b", name="", client="curl",
                          priority="low", prompt_tokens=800, reused_tokens=0, source="none", reason="evicted",
                          detail={"computed": 800, "kind": "evict", "tier": "ram", "when": now - 4, "by": "park",
                                  "budget": "conversation-cache-mib", "matched": 799, "lost_tokens": 800}),
        ]
        self.lock = threading.Lock()

    def health(self) -> tuple[int, dict]:
        """Loading: the weights phase, its fraction growing until --ready-after; then ok."""
        now, wait = time.time(), float(self.args.get("--ready-after", "0"))
        elapsed = now - self.started
        if now >= self.ready_at:
            return 200, to_json(HealthBody(status="ok", phase="ready", elapsed_s=elapsed, progress=1.0))
        return 503, to_json(HealthBody(status="loading", phase="loading weights", elapsed_s=elapsed,
                                       progress=round(min(elapsed / wait, 1.0), 2)))

    def cache_config(self, changed: list[str] | None = None) -> dict:
        from engine.config import LIVE_SETTINGS

        return to_json(CacheConfigBody(settings=dict(self.settings), live=list(LIVE_SETTINGS),
                                       effective_dir="/tmp/stand-in-cache", enabled=True, changed=changed))

    def metrics(self) -> dict:
        with self.lock:
            ram = sum(c.bytes for c in self.conversations if c.tier == "ram")
            disk = sum(c.bytes for c in self.conversations if c.tier == "disk")
            s = self.settings
            return to_json(MetricsBody(
                engine=EngineFigures(model="stand-in", state="ready", slots=1, slots_busy=0, queued=0,
                                     requests=3, uptime_s=12.0, pid=os.getpid(), spec_drafted_tokens=40,
                                     spec_accepted_tokens=30),
                conversation_cache=CacheFigures(
                    enabled=True, storage=s["conversation_cache_storage"], dir="/tmp/x",
                    ram_bytes=s["conversation_cache_mib"] << 20,
                    disk_bytes=s["conversation_cache_disk_mib"] << 20,
                    slots=s["conversation_cache_slots"],
                    min_free_bytes=s["conversation_cache_min_free_mib"] << 20, block_tokens=64,
                    bytes_ram=ram, bytes_disk=disk, hits=2, misses=1, tokens_reused=2400,
                    parks=1, restores=1, park_ms=Timing(4.0, 4.0, 4.0, 1), restore_ms=Timing(2.0, 2.0, 2.0, 1),
                ),
            ))


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
                self._send(*state.health())
            elif url.path == "/metrics":
                self._send(200, state.metrics())
            elif url.path == "/cache/conversations":
                with state.lock:
                    self._send(200, to_json(ConversationsBody(list(state.conversations))))
            elif url.path == "/cache/events":
                limit = int(parse_qs(url.query).get("limit", ["100"])[0])
                self._send(200, to_json(EventsBody(state.events[-limit:])))
            elif url.path == "/cache/config":
                self._send(200, state.cache_config())
            elif url.path == "/cache/requests":
                limit = int(parse_qs(url.query).get("limit", ["1000"])[0])
                self._send(200, to_json(RequestsBody(state.requests[-limit:])))
            else:
                self._send(404, {"error": {"message": f"no route {url.path}"}})

        def do_PUT(self) -> None:
            if self.path != "/cache/config":
                self._send(404, {"error": {"message": "no route"}})
                return
            from engine.config import setting_of
            from engine.setting import SettingError

            body = self._body()
            unknown = [k for k in body if k not in state.settings]
            if unknown:
                self._send(400, {"error": {"message": f"not a live setting: {unknown[0]}"}})
                return
            try:
                parsed = {k: setting_of(k).parse(v) for k, v in body.items()}
            except SettingError as exc:
                self._send(400, {"error": {"message": str(exc)}})
                return
            if "--most-slots" in state.args:  # an engine that takes a value but caps it: its answer says so
                cap = int(state.args["--most-slots"])
                parsed = {k: min(v, cap) if k == "conversation_cache_slots" else v for k, v in parsed.items()}
            changed = [k for k, v in parsed.items() if state.settings[k] != v]
            state.settings.update(parsed)
            if "--old-dialect" in sys.argv:  # the answer of an engine from before the contract
                self._send(200, {"settings": state.settings, "changed": changed})
                return
            self._send(200, state.cache_config(changed))

        def do_PATCH(self) -> None:
            """PATCH /cache/conversations/{id} as COMMON's shape: or, with --no-patch, the answer of an engine
            without the route (the real engine's 404 text)."""
            url = urlparse(self.path)
            if "--no-patch" in sys.argv or not url.path.startswith("/cache/conversations/"):
                self._send(404, {"error": {"message": f"no route PATCH {url.path}; see docs/API.md for the "
                                                      "endpoints"}})
                return
            conv_id = url.path.rsplit("/", 1)[1]
            body = self._body()
            with state.lock:
                found = [c for c in state.conversations if c.id == conv_id]
                if not found:
                    self._send(404, {"error": {"message": f"no parked conversation {conv_id!r}"}})
                    return
                state.conversations = [dataclasses.replace(c, **body) if c.id == conv_id else c
                                       for c in state.conversations]
                rows = [c for c in state.conversations if c.id == conv_id]
            self._send(200, to_json(ConversationsBody(rows)))

        def do_DELETE(self) -> None:
            """DELETE /cache/conversations/{id}: drops the conversation (every tier's row), as the engine does."""
            url = urlparse(self.path)
            conv_id = url.path.rsplit("/", 1)[1]
            with state.lock:
                gone = [c for c in state.conversations if c.id == conv_id]
                state.conversations = [c for c in state.conversations if c.id != conv_id]
            if not url.path.startswith("/cache/conversations/") or not gone:
                self._send(404, {"error": {"message": f"conversation {conv_id!r} is not parked"}})
                return
            dropped = Dropped(conversations=1, bytes=sum(c.bytes for c in gone))
            self._send(200, to_json(PurgeBody(tier="all", dropped=dropped)))

        def do_POST(self) -> None:
            if self.path == "/shutdown":
                self._send(202, {"status": "shutting down"})
                if "--ignore-shutdown" not in sys.argv:
                    threading.Thread(target=lambda: (time.sleep(0.1), os._exit(0)), daemon=True).start()
            elif self.path == "/cache/purge":
                tier = self._body().get("tier", "all")
                with state.lock:
                    gone = [c for c in state.conversations if tier == "all" or c.tier == tier]
                    state.conversations = [c for c in state.conversations if c not in gone]
                dropped = Dropped(conversations=len(gone), bytes=sum(c.bytes for c in gone))
                self._send(200, to_json(PurgeBody(tier=tier, dropped=dropped)))
            else:
                self._send(404, {"error": {"message": "no route"}})

    return Handler


def _exit_when_stdin_closes() -> None:
    """As the engine does (engine/cli.py): its stdin, when a pipe, closing is a request to stop."""
    try:
        if not stat.S_ISFIFO(os.fstat(0).st_mode):
            return
    except OSError:
        return

    def wait() -> None:
        with contextlib.suppress(OSError):
            while os.read(0, 4096):
                pass
        os._exit(0)

    threading.Thread(target=wait, daemon=True).start()


def serve(argv: list[str]) -> None:
    args: dict[str, str] = {}
    for i, a in enumerate(argv):
        if a.startswith("--") and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            args[a] = argv[i + 1]
    if "--ignore-term" in argv:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if "--ignore-shutdown" not in argv:
        _exit_when_stdin_closes()
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
