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
