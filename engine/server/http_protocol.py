"""uvicorn's HTTP/1.1 protocol with a deadline on each request's head: a connection that opens (or, kept alive,
starts a next request) and does not finish its request line and headers within HEAD_TIMEOUT_S is closed.
uvicorn has no such limit: 500 connections that sent half a header line each stayed open for good (slowloris).
The body's own deadline is BodyGuard's (engine/server/guards.py).

Each connection's kernel send buffer is also capped (SEND_BUFFER_BYTES): a stream whose client stopped reading is
cancelled once MAX_UNREAD events wait behind full socket buffers (engine/runtime/stream.py), and Linux grows a send
buffer to 4 MiB (tcp_wmem), ~17,000 events of a chat stream; a client that stopped reading had a whole 8K context
generated for it before the cap."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("strata.server")
HEAD_TIMEOUT_S = 10.0  # a client on this machine sends its headers in milliseconds
SEND_BUFFER_BYTES = 64 << 10  # Linux doubles it: ~550 events of a chat stream, and a LAN's worth of bytes in flight


class HeadDeadlineProtocol(H11Protocol):
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):  # a transport without a real socket keeps the system's buffer
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        self._watch_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        super().connection_lost(exc)

    def _waiting_for_head(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _watch_head(self) -> None:
        """A timer while a request's head is awaited; none once it has come (the request runs)."""
        if not self._waiting_for_head():
            self._stop_timer()
        elif self._head_timer is None:
            self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_timed_out)

    def _stop_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._waiting_for_head() and not self.transport.is_closing():
            log.info("closed a connection whose request head did not arrive within %g s", HEAD_TIMEOUT_S)
            self.transport.close()


