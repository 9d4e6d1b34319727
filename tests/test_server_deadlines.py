"""Incomplete requests are timed out: a connection that never finishes its request head is closed, and a body that
stalls is answered 408 and its bytes let go; meanwhile the server keeps answering others."""

from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

import pytest

from engine.server.guards import BODY_IDLE_S
from engine.server.http_protocol import HEAD_TIMEOUT_S
from tests.engine_process import engine_process


@pytest.fixture(scope="module")
def engine():
    with engine_process("--model", "", "--ctx-size", "256") as proc:
        yield proc


def _connect(engine) -> socket.socket:
    url = urlsplit(engine.base_url)
    sock = socket.create_connection((url.hostname, url.port), timeout=5)
    return sock


def _closed_or_answered(sock: socket.socket, wait_s: float) -> bytes | None:
    """What the server sent before closing (b"" when it closed without a word), or None if it left us open."""
    sock.settimeout(wait_s)
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except TimeoutError:
        return None
    return received


def test_half_sent_heads_and_stalled_bodies_are_let_go(engine):
    heads = [_connect(engine) for _ in range(20)]
    for sock in heads:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty")
    bodies = [_connect(engine) for _ in range(5)]
    for sock in bodies:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n" + b"{" * 99)
    started = time.monotonic()
    assert engine.get_status("/health") == 200, "others are served meanwhile"
    wait = max(HEAD_TIMEOUT_S, BODY_IDLE_S) + 5
    for sock in heads:
        assert _closed_or_answered(sock, wait - (time.monotonic() - started)) == b"", "a half-sent head was kept"
    for sock in bodies:
        answer = _closed_or_answered(sock, max(wait - (time.monotonic() - started), 1))
        assert answer is not None and answer.startswith(b"HTTP/1.1 408"), answer
        assert b"the request body stalled" in answer
    assert engine.get_status("/health") == 200


def test_a_kept_alive_connection_gets_a_new_deadline_for_its_next_head(engine):
    sock = _connect(engine)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    sock.settimeout(10)
    answer = b""
    while b"\r\n\r\n" not in answer:  # the whole first answer, head and body, which may come in pieces
        answer += sock.recv(65536)
    head, _, body = answer.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    assert head.startswith(b"HTTP/1.1 200")
    sock.sendall(b"GET /heal")  # the next request starts, and stops half-way
    assert _closed_or_answered(sock, HEAD_TIMEOUT_S + 5) == b""
