"""The Monitor's poller (desktop/client.py) across an engine restart: a request still waiting on the engine that was
replaced is dropped unanswered, and must not keep the new engine from being polled (it left the app's list of
parked conversations frozen after a crash restart)."""

from __future__ import annotations

import http.server
import json
import threading

from desktop.client import Dispatcher, EngineClient, Poller


class _Engine(http.server.ThreadingHTTPServer):
    """Answers GET /cache/conversations with an empty list; `hold` makes it wait until `release` is set."""

    def __init__(self, hold: bool) -> None:
        self.hold, self.asked, self.release = hold, threading.Event(), threading.Event()
        super().__init__(("127.0.0.1", 0), _Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        server = self.server
        assert isinstance(server, _Engine)
        if self.path != "/cache/conversations":
            self.send_error(404)
            return
        server.asked.set()
        if server.hold:
            server.release.wait(30)
        body = json.dumps({"conversations": []}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def test_a_poll_in_flight_to_a_replaced_engine_does_not_stop_the_polls(qtbot):
    old, new = _Engine(hold=True), _Engine(hold=False)
    dispatcher = Dispatcher()
    client = EngineClient(dispatcher)
    poller = Poller(client, interval_ms=60_000)  # no timer rounds: each poll below is the test's own
    poller.detail = False
    try:
        client.set_target(old.url)
        poller.poll()
        assert old.asked.wait(10)  # the old engine holds the conversations request
        client.set_target(new.url)  # the engine was restarted on another port
        with qtbot.waitSignal(poller.conversations, timeout=10_000) as answered:
            poller.poll()
        assert answered.args == [[]] and new.asked.is_set()
    finally:
        old.release.set()
        for server in (old, new):
            server.shutdown()
            server.server_close()
        dispatcher.close()
