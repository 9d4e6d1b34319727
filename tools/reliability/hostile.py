"""Probe 1, hostile bodies: a few hundred malformed and hostile requests to every route with a body, and a few
broken at the HTTP level; none may get a 5xx or no answer, each refusal is in its API's error shape, and the
engine is healthy afterwards with no traceback in its log."""

from __future__ import annotations

import json
import socket
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

from tools.reliability.common import MIB, RSS_FACTOR, Checks, Options, Result, mib
from tools.reliability.engine import Engine, PeakRss, Reply, request
from tools.reliability.hostile_cases import Case, cases, item_bombs

NAME = "hostile-bodies"
MAX_REQUEST_MIB = 32  # the engine's default
CLIENTS = 4  # requests in flight at once: refusals and generations side by side
RAW = [  # broken at the HTTP level: uvicorn's parser answers 400 or closes
    ("garbage request line", b"GARBAGE\r\n\r\n"),
    ("HTTP/0.9", b"GET /\r\n\r\n"),
    ("HTTP/2 preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"),
    ("negative Content-Length", b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: -1\r\n\r\n"),
    ("Content-Length not a number", b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1e3\r\n\r\n"),
    ("two Content-Lengths", b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}"),
    ("bad chunk size", b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                       b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n"),
    ("huge chunk size", b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                        b"Transfer-Encoding: chunked\r\n\r\nffffffffffffffff\r\n{}\r\n0\r\n\r\n"),
    ("100 KB header", b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: " + b"a" * 100_000 + b"\r\n\r\n"),
    ("2000 headers", b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-A: a\r\n" * 2000 + b"\r\n"),
    ("NUL in header", b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: a\x00b\r\n\r\n"),
    ("Transfer-Encoding gzip", b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                               b"Transfer-Encoding: gzip\r\n\r\n{}"),
]


def run(options: Options) -> Result:
    checks = Checks(NAME)
    engine = Engine.start(["--model", "", "--ctx-size", "1024", "--parallel", "2", "--n-predict", "4",
                           "--conversation-cache-dir", options.folder("hostile-cache"), *options.engine_args],
                          options.folder("logs") + f"/{NAME}.log", cwd=options.folder("hostile-cwd"))
    try:
        warm_up(engine)
        all_cases = cases()
        with PeakRss(engine.proc.pid) as peak, ThreadPoolExecutor(CLIENTS) as pool:
            replies = list(pool.map(lambda case: (case, send(engine, case)), all_cases))
            raw = [(what, send_raw(engine.base_url, data)) for what, data in RAW]
        judge(checks, replies, raw)
        bound = MAX_REQUEST_MIB * MIB * RSS_FACTOR
        checks.note(f"RSS {mib(peak.before)}, peak +{mib(peak.growth)} with {CLIENTS} clients at once")
        checks.expect(peak.growth <= CLIENTS * bound, f"peak RSS grew {mib(peak.growth)} under {CLIENTS} clients, "
                      f"over {mib(CLIENTS * bound)}")
        bombs(checks, engine, bound)
        checks.expect(engine.healthy(), "the engine is not healthy afterwards")
        tracebacks = engine.logs().count("Traceback")
        checks.expect(tracebacks == 0, f"{tracebacks} tracebacks in the engine's log ({engine.log_path})")
    finally:
        engine.terminate()
    return checks.result()


def warm_up(engine: Engine) -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).encode()
    engine.post("/v1/chat/completions", body)


def bombs(checks: Checks, engine: Engine, bound: int) -> None:
    """Each item bomb on its own, its peak RSS and time measured: one request's cost."""
    worst = (0, 0.0, "")
    for case in item_bombs():
        started = time.monotonic()
        with PeakRss(engine.proc.pid) as peak:
            reply = send(engine, case)
        seconds = time.monotonic() - started
        worst = max(worst, (peak.growth, seconds, f"{case.path} {case.what}"))
        checks.expect(0 < reply.status < 500, f"{case.path} {case.what}: {reply.status} {reply.body[:120]!r}")
        checks.expect(peak.growth <= bound, f"{case.path} {case.what} ({mib(len(case.body))}): peak RSS grew "
                      f"{mib(peak.growth)} in {seconds:.1f} s, over {mib(bound)}")
    checks.note(f"item bombs: worst +{mib(worst[0])} in {worst[1]:.1f} s ({worst[2]})")


def send(engine: Engine, case: Case) -> Reply:
    return request(engine.base_url, case.method, case.path, case.body, headers=case.headers, timeout=120)


def judge(checks: Checks, replies: list[tuple[Case, Reply]], raw: list[tuple[str, int]]) -> None:
    statuses = Counter(reply.status for _, reply in replies)
    checks.note(f"{len(replies)} requests over {len({c.path for c, _ in replies})} routes: "
                + " ".join(f"{s}x{n}" for s, n in sorted(statuses.items())))
    bad = [f"{c.method} {c.path} {c.what}: {r.status} {r.body[:120]!r}" for c, r in replies
           if r.status == 0 or r.status >= 500]
    checks.expect(not bad, f"{len(bad)} answered 5xx or not at all, e.g. {bad[:3]}")
    misshapen = [f"{c.path} {c.what}: {r.body[:120]!r}" for c, r in replies
                 if 400 <= r.status < 500 and not in_error_shape(c.path, r)]
    checks.expect(not misshapen, f"{len(misshapen)} refusals not in their API's error shape, e.g. {misshapen[:3]}")
    raw_bad = [f"{what}: {status}" for what, status in raw if status >= 500]
    checks.note(f"{len(raw)} broken at the HTTP level: " + " ".join(sorted({str(s) for _, s in raw})))
    checks.expect(not raw_bad, f"HTTP-level breakage answered 5xx: {raw_bad}")


def in_error_shape(path: str, reply: Reply) -> bool:
    """OpenAI's {"error": {message, type, param, code}}, or Anthropic's under /v1/messages."""
    try:
        body = reply.json()
    except ValueError:
        return False
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        return False
    error = body["error"]
    if path.startswith("/v1/messages"):
        return body.get("type") == "error" and bool(error.get("message")) and bool(error.get("type"))
    return bool(error.get("message")) and error.get("code") == reply.status


def send_raw(base_url: str, data: bytes) -> int:
    """The status of the answer to raw bytes (0 when the server closed without one)."""
    url = urlsplit(base_url)
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            first = sock.recv(64)
        except OSError:
            return 0
    parts = first.split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[0].startswith(b"HTTP/") and parts[1].isdigit() else 0
