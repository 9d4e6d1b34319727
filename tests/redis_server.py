"""A real redis-server for a test: on a free loopback port, nothing saved, stopped (and its log kept) at the end.

    with redis_server(tmp_path) as store:
        engine_flags = ("--conversation-cache-remote", store.url)

Tests that need one skip, saying why, when the binary is missing (scripts/setup.sh installs it).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import redis

BINARY = shutil.which("redis-server")


@dataclass
class RedisServer:
    proc: subprocess.Popen
    port: int
    log_path: str
    password: str = ""

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password or None)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def logs(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def redis_server(folder: os.PathLike | str, *args: str, port: int = 0, password: str = "") -> Iterator[RedisServer]:
    """Start redis-server (256 MiB, LRU eviction unless `args` say otherwise; `password` required if given) and
    wait until it answers."""
    if BINARY is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server; scripts/setup.sh does it)")
    port = port or free_port()
    log_path = os.path.join(folder, f"redis-{port}.log")
    cmd = [BINARY, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
           "--dir", str(folder), "--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru",
           *(["--requirepass", password] if password else []), *args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    server = RedisServer(proc, port, log_path, password)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                server.client().ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start:\n{server.logs()}") from None
                time.sleep(0.05)
        yield server
    finally:
        server.stop()


@dataclass
class SharedResume:
    """What `resume_through_store` saw: the never-parked engine's second turn and engine B's, B's cached tokens,
    the first turn's prompt length and B's cache figures."""

    reference: list[int]
    resumed: list[int]
    cached: int
    first_prompt: int
    stats: dict


def resume_through_store(config, messages: list[dict], folder: os.PathLike | str, max_tokens: int = 12
                         ) -> SharedResume:
    """Engine A (in this process, tiered, its own folder) answers `messages` and closes, which parks it through to
    a real redis-server; engine B (its own folder) answers the next turn from the store. The reference is a
    third engine, without the store, answering both turns in a row. `config`: an EngineConfig."""
    from engine.runtime.engine import Engine
    from tools.conversation_cache_parity import _generate

    config = config.replace(conversation_cache_storage="tiered")
    ref = Engine.from_config(config.replace(conversation_cache_dir=os.path.join(folder, "ref")))
    try:
        a1, _, _ = _generate(ref, messages, 4)
        turn2 = messages + [{"role": "assistant", "content": a1}, {"role": "user", "content": "Go on."}]
        _, reference, _ = _generate(ref, turn2, max_tokens)
    finally:
        ref.close()
    with redis_server(folder) as store:
        a = Engine.from_config(config.replace(conversation_cache_dir=os.path.join(folder, "a"),
                                              conversation_cache_remote=store.url))
        try:
            _generate(a, messages, 4)
            first_prompt = len(a.tokenizer.encode(a.tokenizer.render_chat(messages), add_special_tokens=False))
        finally:
            a.close()  # parks A's slot, written through to the store before it returns
        b = Engine.from_config(config.replace(conversation_cache_dir=os.path.join(folder, "b"),
                                              conversation_cache_remote=store.url))
        try:
            _, resumed, cached = _generate(b, turn2, max_tokens)
            stats = b.call(b.cache_stats).result()
        finally:
            b.close()
    return SharedResume(reference, resumed, cached, first_prompt, stats)
