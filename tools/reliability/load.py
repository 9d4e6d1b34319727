"""Probe 6, load: N clients hold conversations of a few turns each for D seconds, each turn streamed or not, through
Chat Completions or the Messages API, against an engine with two slots; no request may fail, and the p50/p95
latency of a turn (queueing included) is printed."""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter

from tools.reliability.common import Checks, Options, Result, percentile, words
from tools.reliability.engine import Engine, request

NAME = "load"
TURNS = 5  # then the client starts a new conversation
MAX_TOKENS = 16


def run(options: Options) -> Result:
    checks = Checks(NAME)
    engine = Engine.start(["--model", "", "--ctx-size", "2048", "--parallel", "2",
                           "--conversation-cache-dir", options.folder("load-cache"), *options.engine_args],
                          options.folder("logs") + f"/{NAME}.log", cwd=options.workdir)
    try:
        stop = threading.Event()
        clients = [Client(engine.base_url, options.seed * 1000 + i, stop) for i in range(options.load_clients)]
        threads = [threading.Thread(target=client.run, daemon=True) for client in clients]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        time.sleep(options.load_seconds)
        stop.set()
        for thread in threads:
            thread.join(180)
        elapsed = time.monotonic() - started
        latencies = [s for client in clients for s in client.latencies]
        failures = Counter(f for client in clients for f in client.failures)
        kinds = Counter(k for client in clients for k in client.kinds)
        checks.note(f"{options.load_clients} clients for {options.load_seconds:g} s: {len(latencies)} turns "
                    f"({', '.join(f'{k} {n}' for k, n in sorted(kinds.items()))}), {sum(failures.values())} failed; "
                    f"latency p50 {percentile(latencies, 0.5):.2f} s, p95 {percentile(latencies, 0.95):.2f} s; "
                    f"{len(latencies) / elapsed:.1f} turns/s")
        checks.expect(not failures, f"failures: {dict(failures.most_common(5))}")
        checks.expect(len(latencies) >= options.load_clients, "fewer turns than clients were answered")
        checks.expect(engine.healthy(), "the engine is not healthy afterwards")
        checks.expect("Traceback" not in engine.logs(), f"a traceback in the engine's log ({engine.log_path})")
    finally:
        engine.terminate()
    return checks.result()


class Client:
    """One user: conversations of TURNS turns, each turn through a seeded choice of API and streaming."""

    def __init__(self, base_url: str, seed: int, stop: threading.Event) -> None:
        self.base_url = base_url
        self.rng = random.Random(seed)
        self.stop = stop
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self.kinds: list[str] = []

    def run(self) -> None:
        while not self.stop.is_set():
            messages: list[dict] = []
            for turn in range(TURNS):
                if self.stop.is_set():
                    return
                messages.append({"role": "user", "content": words(self.rng.randint(20, 120), self.rng.randrange(1 << 20))
                                 + ("\nSum this up." if turn == 0 else "\nAnd then?")})
                answer = self.turn(messages)
                if answer is None:
                    break
                messages.append({"role": "assistant", "content": answer})

    def turn(self, messages: list[dict]) -> str | None:
        api = self.rng.choice(["chat", "messages"])
        stream = self.rng.random() < 0.5
        self.kinds.append(f"{api}{' stream' if stream else ''}")
        path = "/v1/chat/completions" if api == "chat" else "/v1/messages"
        body = {"messages": messages, "max_tokens": MAX_TOKENS, "stream": stream, "model": "m"}
        started = time.monotonic()
        reply = request(self.base_url, "POST", path, json.dumps(body).encode(), timeout=300)
        seconds = time.monotonic() - started
        answer = parse(api, stream, reply.body) if reply.status == 200 else None
        if answer is None:
            self.failures.append(f"{api}{' stream' if stream else ''} {reply.status} {reply.body[:80]!r}")
            return None
        self.latencies.append(seconds)
        return answer


def parse(api: str, stream: bool, body: bytes) -> str | None:
    """The answer's text, or None when the reply is not a complete answer of its API."""
    try:
        if not stream:
            data = json.loads(body)
            if api == "chat":
                return data["choices"][0]["message"]["content"] or ""
            return "".join(block.get("text", "") for block in data["content"])
        events = [json.loads(line[6:]) for line in body.decode().splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        if api == "chat":
            complete = body.rstrip().endswith(b"data: [DONE]")
            return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices")) \
                if complete else None
        complete = any(e.get("type") == "message_stop" for e in events)
        return "".join(e["delta"].get("text", "") for e in events if e.get("type") == "content_block_delta") \
            if complete else None
    except (ValueError, KeyError, IndexError, TypeError):
        return None
