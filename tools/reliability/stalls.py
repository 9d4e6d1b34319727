"""Probe 3, stalled connections: 200 connections that send half a header line and 20 bodies stalled one byte short
are all let go within the server's deadlines (engine/server/http_protocol.py, engine/server/guards.py) while others
are served; and (not with --quick: it takes minutes of decoding) a client that stops reading its stream gets its
generation cancelled, with the engine's RSS bounded meanwhile."""

from __future__ import annotations

import json
import selectors
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

from engine.runtime.stream import MAX_UNREAD
from engine.server.guards import BODY_IDLE_S
from engine.server.http_protocol import HEAD_TIMEOUT_S
from tools.reliability.common import MIB, RSS_FACTOR, Checks, Options, Result, mib
from tools.reliability.engine import Engine, PeakRss

NAME = "stalled-connections"
HEADS, BODIES = 200, 20
KEEP_ALIVE_S = 5.0  # uvicorn's default timeout_keep_alive (engine/cli.py keeps it): a connection answered 408 is
# closed once it has been idle that long
GRACE_S = 5.0  # how late a deadline's close may come: its timer shares a loop with 220 sockets and other requests
HALF_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty"
SHORT_BODY = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: 100\r\n\r\n" + b"{" * 99)
CTX = 8192  # the bundled model's own: room for MAX_UNREAD events and the socket buffers before them
MAX_REQUEST_MIB = 32  # the engine's default
UNREAD_LIMIT_S = 900.0  # ~5,000 tokens at the slowest decode seen on a busy 2-core machine, twice over


def run(options: Options) -> Result:
    checks = Checks(NAME)
    # No RAM parking: the unread stream's conversation, parked, would add its K/V to the RSS measured.
    engine = Engine.start(["--model", "", "--ctx-size", str(CTX), "--parallel", "1", "--conversation-cache-mib", "0",
                           "--conversation-cache-dir", options.folder("stalls-cache"), *options.engine_args],
                          options.folder("logs") + f"/{NAME}.log", cwd=options.workdir)
    try:
        unread = None if options.quick else UnreadStream(engine)  # decodes while the stalls wait out
        stalls(checks, engine)
        if unread is not None:
            unread.judge(checks)
        else:
            checks.note(f"a stream nobody reads: not with --quick (~{MAX_UNREAD:,} tokens to decode)")
        checks.expect(engine.healthy(), "the engine is not healthy afterwards")
    finally:
        engine.terminate()
    return checks.result()


def connect(base_url: str, data: bytes) -> socket.socket:
    url = urlsplit(base_url)
    sock = socket.create_connection((url.hostname, url.port), timeout=10)
    sock.sendall(data)
    return sock


def stalls(checks: Checks, engine: Engine) -> None:
    fds_before = engine.ps.num_fds()
    heads = [connect(engine.base_url, HALF_HEAD) for _ in range(HEADS)]
    bodies = [connect(engine.base_url, SHORT_BODY) for _ in range(BODIES)]
    sent = time.monotonic()
    healthy = engine.get("/health", timeout=5).status == 200
    health_ms = (time.monotonic() - sent) * 1000
    fds_held = engine.ps.num_fds()
    ends = wait_closed(heads + bodies, sent, BODY_IDLE_S + KEEP_ALIVE_S + GRACE_S)
    time.sleep(0.5)  # the server's side of the last close
    fds_after = engine.ps.num_fds()
    heads_end, bodies_end = ends[:HEADS], ends[HEADS:]
    kept = sum(not end.closed_within(HEAD_TIMEOUT_S + GRACE_S) or end.data != b"" for end in heads_end)
    unanswered = sum(not end.answered_within(BODY_IDLE_S + GRACE_S) or not end.data.startswith(b"HTTP/1.1 408")
                     for end in bodies_end)
    open_bodies = sum(not end.closed_within(BODY_IDLE_S + KEEP_ALIVE_S + GRACE_S) for end in bodies_end)
    checks.note(f"{HEADS} half-sent heads closed after {span(e.closed for e in heads_end)} (deadline "
                f"{HEAD_TIMEOUT_S:g} s); {BODIES} stalled bodies answered 408 after "
                f"{span(e.answered for e in bodies_end)} (deadline {BODY_IDLE_S:g} s), closed after "
                f"{span(e.closed for e in bodies_end)}; /health answered in {health_ms:.0f} ms meanwhile; "
                f"engine fds {fds_before} -> {fds_held} -> {fds_after}")
    checks.expect(healthy, "/health was not answered while the connections stalled")
    checks.expect(kept == 0, f"{kept} half-sent heads were not closed within {HEAD_TIMEOUT_S + GRACE_S:g} s")
    checks.expect(unanswered == 0, f"{unanswered} stalled bodies got no 408 within {BODY_IDLE_S + GRACE_S:g} s")
    checks.expect(open_bodies == 0, f"{open_bodies} stalled bodies' connections stayed open")
    checks.expect(fds_after <= fds_before + 5, f"the engine still holds {fds_after - fds_before} more descriptors")
    for sock in heads + bodies:
        sock.close()


@dataclass
class End:
    """What a stalled connection got: when the server first answered and when it closed (seconds from the
    stall, None: not by the end of the wait), and the bytes it sent."""

    answered: float | None = None
    closed: float | None = None
    data: bytes = b""

    def answered_within(self, limit: float) -> bool:
        return self.answered is not None and self.answered <= limit

    def closed_within(self, limit: float) -> bool:
        return self.closed is not None and self.closed <= limit


def span(times: Iterable[float | None]) -> str:
    seen = [t for t in times if t is not None]
    return f"{min(seen):.1f}-{max(seen):.1f} s" if seen else "never"


def wait_closed(socks: list[socket.socket], since: float, limit: float) -> list[End]:
    """What each socket got until the server closed it or `limit` seconds after `since` passed."""
    selector = selectors.DefaultSelector()
    ends = {sock: End() for sock in socks}
    for sock in socks:
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
    waiting = len(socks)
    while waiting and (left := since + limit - time.monotonic()) > 0:
        for key, _ in selector.select(timeout=left):
            sock = cast(socket.socket, key.fileobj)
            end = ends[sock]
            try:
                chunk = sock.recv(65536)
            except OSError:
                chunk = b""
            if chunk:
                end.answered = end.answered or time.monotonic() - since
                end.data += chunk
                continue
            end.closed = time.monotonic() - since
            selector.unregister(sock)
            waiting -= 1
    selector.close()
    return [ends[sock] for sock in socks]


class UnreadStream:
    """A streaming request whose client never reads a byte (and keeps its receive buffer small)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        metrics = engine.get("/metrics").json()
        assert isinstance(metrics, dict)
        self.kv_bytes = int(metrics["engine"]["kv_bytes"])
        body = json.dumps({"messages": [{"role": "user", "content": "Tell a long story."}], "stream": True,
                           "max_tokens": CTX - 100, "ignore_eos": True, "temperature": 0}).encode()
        url = urlsplit(engine.base_url)
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.connect((url.hostname, url.port))
        self.peak = PeakRss(engine.proc.pid).start()
        self.started = time.monotonic()
        self.sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                          b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)

    def judge(self, checks: Checks) -> None:
        tokens = self.wait_idle()
        seconds = time.monotonic() - self.started
        self.peak.stop()
        self.sock.close()
        cancelled = "stopped reading, request cancelled" in self.engine.logs()
        # The slot's K/V fills as it generates (its pages are touched then): a normal cost, not the stream's.
        bound = self.kv_bytes + MAX_REQUEST_MIB * MIB * RSS_FACTOR
        checks.note(f"a stream nobody reads: {'cancelled' if cancelled else 'not cancelled'} after {seconds:.0f} s "
                    f"at {tokens:,} tokens in its slot (MAX_UNREAD {MAX_UNREAD:,}), peak RSS +{mib(self.peak.growth)}")
        checks.expect(cancelled, f"a client that stopped reading was not cancelled: the engine generated {tokens:,} "
                      f"tokens for it in {seconds:.0f} s")
        checks.expect(self.peak.growth <= bound, f"RSS grew {mib(self.peak.growth)} under an unread stream, over "
                      f"the slot's K/V and {RSS_FACTOR}x the request limit ({mib(bound)})")

    def wait_idle(self) -> int:
        """Tokens in the slot when the request ended (cancelled or done), polled from /slots."""
        tokens = 0
        while time.monotonic() - self.started < UNREAD_LIMIT_S:
            slots = self.engine.get("/slots", timeout=10).json()
            assert isinstance(slots, list)
            if all(slot["state"] != "busy" for slot in slots):
                return tokens
            tokens = max(slot["n_tokens"] for slot in slots)
            time.sleep(1.0)
        return tokens
