"""Probe 2, large prompts: 10 and 30 MB prompts (a quarter of that with --quick), one request at a time, through
every API and shape; the engine's peak RSS above its idle RSS stays within --max-request-mib x RSS_FACTOR. Then
clients that send long prompts and leave after 0.5 s: the engine stops within a prefill chunk per slot, and SIGTERM
ends it within EXIT_S."""

from __future__ import annotations

import json
import socket
import threading
import time
from urllib.parse import urlsplit

from tools.reliability.common import (
    EXIT_S,
    MIB,
    QUIET_CPU,
    QUIET_LIMIT_S,
    RSS_FACTOR,
    Checks,
    Options,
    Result,
    mib,
    words,
)
from tools.reliability.engine import Engine, PeakRss, Reply, seconds_until_quiet

NAME = "large-prompts"
# Bodies made of many tiny JSON values rather than text (a token-id prompt, a million tiny messages, ten million
# empty input items): each value costs a parser node and a Python object, 14-62x the body's bytes in all at 30 MB
# (measured on fresh engines; docs/DEVELOPERS.md), whatever the engine does with it afterwards. A separate, looser
# bound: it is the price of JSON values, not of the prompt; it still catches a cost per value like the one error
# per bad item that took 2 MB to 1.3 GB.
STRUCTURE_FACTOR = 96
LEAVE_AFTER_S = 0.5
CTX = 4096
SLOTS = 2
PREFILL_CHUNK = 512  # the engine's default, passed explicitly: a prefill notices its client left between chunks
# What the engine may still compute once its clients left: the chunk each slot was in, twice over (a chunk that
# began just before they left, and the timing's noise), plus a second for the bodies still being parsed. Measured
# in CPU seconds, which a busy machine does not stretch as it stretches wall time (12 s for one chunk at load 8).
CHUNKS_AFTER_LEAVING = 2 * SLOTS
PARSING_S = 1.0
LONG_PROMPT_WORDS = 1200  # ~1,450 tokens: three prefill chunks, ~6 s on a 2-core CPU, if nobody stopped them
WARM_UP_WORDS = 450  # a whole prefill chunk (~540 tokens): its buffers belong to the idle engine


def run(options: Options) -> Result:
    checks = Checks(NAME)
    limit = (8 if options.quick else 32) * MIB
    sizes = (limit * 5 // 16, limit * 15 // 16)  # 10 and 30 MiB under the default 32 MiB limit
    engine = Engine.start(["--model", "", "--ctx-size", str(CTX), "--parallel", str(SLOTS),
                           "--prefill-chunk", str(PREFILL_CHUNK),
                           "--max-request-mib", str(limit // MIB),
                           "--conversation-cache-dir", options.folder("large-cache"), *options.engine_args],
                          options.folder("logs") + f"/{NAME}.log", cwd=options.workdir)
    try:
        cpu_per_token = prefill_cost(engine)
        idle = engine.rss()
        checks.note(f"limit {mib(limit)}, idle RSS {mib(idle)}")
        text_prompts(checks, engine, sizes, limit, idle)
        structured(checks, engine, sizes[-1], limit)
        leaving_clients(checks, engine, sizes[-1], limit, cpu_per_token)
        exit_s = engine.terminate()
        checks.note(f"SIGTERM: exited in {exit_s:.1f} s with status {engine.proc.returncode}")
        checks.expect(exit_s <= EXIT_S and engine.proc.returncode == 0,
                      f"SIGTERM took {exit_s:.1f} s (bound {EXIT_S:g}), status {engine.proc.returncode}")
    finally:
        engine.kill()
    return checks.result()


def ask(engine: Engine, text: str) -> Reply:
    body = json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": 1}).encode()
    return engine.post("/v1/chat/completions", body, timeout=300)


def prefill_cost(engine: Engine) -> float:
    """CPU seconds per prompt token of a prefill (a whole chunk: its buffers then belong to the idle engine)."""
    before = engine.cpu_s()
    reply = ask(engine, words(WARM_UP_WORDS, 999))
    data = reply.json()
    assert reply.status == 200 and isinstance(data, dict), reply.body[:300]
    return (engine.cpu_s() - before) / data["usage"]["prompt_tokens"]


def text_of(n_bytes: int, ascii_only: bool = True) -> str:
    if not ascii_only:
        return "é中" * (n_bytes // 5)  # 5 bytes of UTF-8 per pair
    block = words(4000, 1) + " "
    return (block * (n_bytes // len(block) + 1))[:n_bytes]


def text_bodies(size: int) -> list[tuple[str, str, bytes]]:
    """(shape, route, body) of a prompt of about `size` bytes of text, each way the APIs take one."""
    text, short = text_of(size), words(50, 2)
    many = [{"role": "user", "content": short}] * (size // (len(short) + 30))
    tool = {"type": "function", "function": {"name": "f", "description": text, "parameters": {"type": "object"}}}
    shapes = [
        ("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 1}),
        ("chat non-ASCII", "/v1/chat/completions",
         {"messages": [{"role": "user", "content": text_of(size, False)}], "max_tokens": 1}),
        ("chat messages", "/v1/chat/completions", {"messages": many, "max_tokens": 1}),
        ("chat tool", "/v1/chat/completions", {"messages": [{"role": "user", "content": short}], "tools": [tool]}),
        ("completions", "/v1/completions", {"prompt": text, "max_tokens": 1}),
        ("messages", "/v1/messages", {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": text}]}),
        ("count_tokens", "/v1/messages/count_tokens", {"messages": [{"role": "user", "content": text}]}),
        ("responses", "/v1/responses", {"input": text, "max_output_tokens": 16}),
    ]
    return [(shape, route, json.dumps(body, ensure_ascii=False).encode()) for shape, route, body in shapes]


def structured_bodies(size: int) -> list[tuple[str, str, bytes]]:
    ids = "[" + "31337," * (size // 6) + "1]"
    tiny = "[" + '{"role":"user","content":""},' * (size // 29) + '{"role":"user","content":"x"}]'
    empty = "[" + "{}," * (size // 3) + "{}]"
    return [("token ids", "/v1/completions", f'{{"prompt":{ids},"max_tokens":1}}'.encode()),
            ("tiny messages", "/v1/chat/completions", f'{{"messages":{tiny},"max_tokens":1}}'.encode()),
            ("empty input items", "/v1/responses", f'{{"input":{empty}}}'.encode())]


def text_prompts(checks: Checks, engine: Engine, sizes: tuple[int, ...], limit: int, idle: int) -> None:
    bound = limit * RSS_FACTOR
    worst = (0, "")
    for size in sizes:
        for shape, route, body in text_bodies(size):
            with PeakRss(engine.proc.pid) as peak:
                status = engine.post(route, body, timeout=300).status
            above = peak.peak - idle
            worst = max(worst, (above, f"{shape} {mib(len(body))}"))
            checks.expect(0 < status < 500, f"{shape} {mib(len(body))} to {route}: status {status}")
            checks.expect(above <= bound, f"{shape} {mib(len(body))}: peak RSS {mib(above)} above idle, "
                          f"over {RSS_FACTOR} x the limit ({mib(bound)})")
    checks.note(f"text prompts {'/'.join(mib(s) for s in sizes)}: peak +{mib(worst[0])} above idle "
                f"({worst[1]}; bound {RSS_FACTOR}x = {mib(bound)})")


def structured(checks: Checks, engine: Engine, size: int, limit: int) -> None:
    bound = limit * STRUCTURE_FACTOR
    figures = []
    for shape, route, body in structured_bodies(size):
        started = time.monotonic()
        with PeakRss(engine.proc.pid) as peak:
            status = engine.post(route, body, timeout=600).status
        figures.append(f"{shape} +{mib(peak.growth)} in {time.monotonic() - started:.1f} s")
        checks.expect(0 < status < 500, f"{shape} {mib(len(body))} to {route}: status {status}")
        checks.expect(peak.growth <= bound, f"{shape} {mib(len(body))}: peak RSS grew {mib(peak.growth)}, over "
                      f"{STRUCTURE_FACTOR} x the limit ({mib(bound)})")
    checks.note(f"{mib(size)} of tiny JSON values: {', '.join(figures)} (bound {STRUCTURE_FACTOR}x)")


def leaving_clients(checks: Checks, engine: Engine, size: int, limit: int, cpu_per_token: float) -> None:
    """Four clients with prompts that take seconds to prefill and two with a body near the limit, all gone
    LEAVE_AFTER_S after sending: the engine's CPU time stops growing once each slot's chunk is done."""
    bodies = [json.dumps({"messages": [{"role": "user", "content": words(LONG_PROMPT_WORDS, seed)}],
                          "max_tokens": 64}).encode() for seed in range(4)]
    bodies += [body for shape, _, body in text_bodies(size) if shape == "chat"] * 2
    url = urlsplit(engine.base_url)
    with PeakRss(engine.proc.pid) as peak:
        threads = [threading.Thread(target=send_and_leave, args=(url.hostname, url.port, body)) for body in bodies]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        left = engine.cpu_s()
        quiet = seconds_until_quiet(engine, QUIET_LIMIT_S, QUIET_CPU)
        cpu_after = engine.cpu_s() - left
    cpu_bound = CHUNKS_AFTER_LEAVING * PREFILL_CHUNK * cpu_per_token + PARSING_S
    rss_bound = 2 * limit * RSS_FACTOR  # two bodies near the limit at once
    checks.note(f"{len(bodies)} clients left after {LEAVE_AFTER_S:g} s: idle again {quiet:.1f} s later, having used "
                f"{cpu_after:.1f} CPU s (bound {cpu_bound:.1f}: {CHUNKS_AFTER_LEAVING} chunks of {PREFILL_CHUNK} "
                f"tokens at {cpu_per_token * 1000:.1f} ms each), peak RSS +{mib(peak.growth)}")
    checks.expect(quiet <= QUIET_LIMIT_S, f"the engine still worked {quiet:.0f} s after its clients left")
    checks.expect(cpu_after <= cpu_bound, f"the engine used {cpu_after:.1f} CPU s after its clients left, over "
                  f"{cpu_bound:.1f}")
    checks.expect(peak.growth <= rss_bound, f"clients that left: peak RSS grew {mib(peak.growth)}, over "
                  f"{mib(rss_bound)}")
    checks.expect(engine.healthy() and ask(engine, "Hello").status == 200, "the engine does not answer afterwards")


def send_and_leave(host: str, port: int, body: bytes) -> None:
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        time.sleep(LEAVE_AFTER_S)
