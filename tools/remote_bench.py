"""First request of a long conversation on engine B after engine A served it: cold, or restored from a shared
redis-server on loopback, or through a link limited to a given rate (a proxy in this process, so nothing of the
machine's network is changed).

Engine A (its own cache folder, the store as --conversation-cache-remote) answers the conversation's first turn
and stops cleanly, which parks it and writes it through to the store. Then for each case a fresh engine B (its
own empty folder) is sent the second turn: its time to first token, the cached tokens, the bytes it read from
the store. Printed: the table, bytes moved per token, the prefill rate B measured cold, and the break-even link
rate, and per link speed the predicted time of this first request, that follow from them.

    python tools/remote_bench.py --tokens 7500 --link-mbit 1000 --link-mbit 100
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.alternating_bench import Server, filler, free_port, ttft  # noqa: E402

MIB = 1 << 20
BLOCK = 64  # --conversation-cache-block-tokens' default, which the engines here keep: the store holds whole blocks


def start_store(folder: str, maxmemory_mib: int) -> tuple[subprocess.Popen, int]:
    """redis-server on a free loopback port, nothing saved, LRU eviction under `maxmemory_mib`."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", folder, "--maxmemory", f"{maxmemory_mib}mb", "--maxmemory-policy", "allkeys-lru"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, port
        time.sleep(0.05)
    proc.kill()
    raise SystemExit("redis-server did not start")


class RateLimitedProxy:
    """A TCP proxy on a free loopback port to `target`, each direction paced to `rate` bytes/s (a slow link's
    bandwidth; its latency is loopback's)."""

    def __init__(self, target: int, rate: float) -> None:
        self.target, self.rate = target, rate
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            client, _ = self.listener.accept()
            upstream = socket.create_connection(("127.0.0.1", self.target))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        sent, t0 = 0, time.perf_counter()
        try:
            while data := src.recv(256 << 10):
                dst.sendall(data)
                sent += len(data)
                ahead = sent / self.rate - (time.perf_counter() - t0)
                if ahead > 0:
                    time.sleep(ahead)
                elif ahead < -0.05:  # idle between requests: the link does not bank unused time
                    sent, t0 = 0, time.perf_counter()
        except OSError:
            pass
        finally:
            for s in (src, dst):
                s.close()


def engine(flags: list[str]) -> Server:
    port = free_port()
    server = Server([sys.executable, "-m", "engine", "serve", "--port", str(port), *flags])
    server.wait_ready(port)
    return server


def client_of(server: Server):
    from openai import OpenAI

    return OpenAI(base_url=server.base + "/v1", api_key="none", timeout=1800, max_retries=0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=7500,
                    help="about this many prompt tokens in the conversation (the bundled model holds 8192)")
    ap.add_argument("--link-mbit", type=float, action="append", default=None,
                    help="also through a proxy limited to this many Mbit/s (repeatable; default 1000)")
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args(argv)
    links = args.link_mbit or [1000.0]
    work = tempfile.mkdtemp(prefix="strata-remote-bench-")
    store, port = start_store(work, maxmemory_mib=4096)
    url = f"redis://127.0.0.1:{port}/0"
    common = ["--ctx-size", str(args.tokens + 2048), "--conversation-cache-min-free-mib", "0",
              "--conversation-cache-write-buffer-mib", "4096"]
    first = [{"role": "system", "content": "You answer in one short sentence."},
             {"role": "user", "content": filler(int(args.tokens / 1.17), seed=3) + "\nWhat is this text about?"}]
    rows = []
    try:
        a = engine([*common, "--conversation-cache-storage", "tiered", "--conversation-cache-dir",
                    os.path.join(work, "a"), "--conversation-cache-remote", url])
        _, a1, _ = ttft(client_of(a), "m", first, args.max_tokens)
        a.stop()  # parks the live slot and writes it through before exiting
        second = first + [{"role": "assistant", "content": a1}, {"role": "user", "content": "Say it again."}]
        cases = [("cold (no store)", None), ("store on loopback", url)]
        proxies = [RateLimitedProxy(port, mbit * 1e6 / 8) for mbit in links]
        cases += [(f"store through {mbit:g} Mbit/s", f"redis://127.0.0.1:{p.port}/0")
                  for mbit, p in zip(links, proxies, strict=True)]
        for i, (name, remote) in enumerate(cases):
            flags = [*common, "--conversation-cache-dir", os.path.join(work, f"b{i}")]
            if remote:
                flags += ["--conversation-cache-remote", remote]
            b = engine(flags)
            try:
                seconds, text, cached = ttft(client_of(b), "m", second, args.max_tokens)
                m = b.metrics()
            finally:
                b.stop()
            c = m["conversation_cache"]
            rows.append((name, seconds, cached, c.get("remote_bytes_got", 0), m["engine"]["prompt_tokens"], text))
    finally:
        store.kill()
        store.wait()
        shutil.rmtree(work, ignore_errors=True)

    print(f"load average {os.getloadavg()[0]:.2f}; prompt {rows[0][4]} tokens")
    print(f"{'first request on engine B':<28} {'TTFT s':>8} {'cached':>7} {'MiB read':>9}  bytes/block token")
    for name, seconds, cached, got, _, _ in rows:
        per = f"{got / (cached // BLOCK * BLOCK):,.0f}" if cached >= BLOCK and got else "–"
        print(f"{name:<28} {seconds:>8.2f} {cached:>7} {got / MIB:>9.1f}  {per}")
    same = len({r[5] for r in rows}) == 1
    print(f"greedy answers identical in every case: {same}")
    cold, loop = rows[0], rows[1]
    rate = cold[4] / cold[1]  # tokens/s of the cold first request (its prefill and one decode step)
    if loop[2] and loop[3]:
        bpt = loop[3] / (loop[2] // BLOCK * BLOCK)
        link_s = loop[1] - (loop[4] - loop[2]) / rate  # the loopback restore's own time, beyond the uncached tail
        print(f"cold: {rate:,.0f} prompt tokens/s; restoring a token moves {bpt:,.0f} bytes, so a link moves "
              f"it faster than prefill above {bpt * rate * 8 / 1e6:,.0f} Mbit/s")
        print(f"per link speed, predicted for this prompt (loopback's {link_s:.2f} s + the bytes at the link's rate):")
        for mbit in (100, 1000, 10000):
            predicted = loop[1] + loop[3] * 8 / (mbit * 1e6)
            print(f"  {mbit:>6} Mbit/s: {predicted:6.2f} s from the store vs {cold[1]:.2f} s cold")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
