"""Many clients at once, then a kill -9 and a restart: does the server keep serving, and what comes back?

    python tools/client_load_bench.py [--clients 8] [--conversations 16] [--seconds 180] [--parallel 2]

A `strata serve --parallel P --conversation-cache-mib 512 --conversation-cache-storage tiered` on a fresh
folder; C client threads (the `openai` SDK, 120 s timeout, no retries) take turns on N conversations (each a
300-800-word first message, then short follow-ups; `max_tokens` 16, greedy), client i owning conversations
i, i+C, ...; a probe thread times `GET /metrics` and `GET /cache/conversations` every 2 s. After the run the
server is killed with SIGKILL, restarted on the same folder, and the time to `/health` 200 and the conversations
found are reported against those `/cache/conversations` listed as `on_disk` just before the kill.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools.alternating_bench import filler, start_strata  # noqa: E402


def _get(base: str, path: str) -> tuple[float, dict]:
    t0 = time.perf_counter()
    with urllib.request.urlopen(base + path, timeout=60) as r:
        body = json.loads(r.read())
    return time.perf_counter() - t0, body


def _pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(p * (len(ordered) - 1) + 0.5))], 3)


def run(args) -> dict:
    from openai import OpenAI

    folder = tempfile.mkdtemp(prefix="strata-load-")
    flags = ["--parallel", str(args.parallel), "--conversation-cache-mib", "512", "--conversation-cache-storage",
             "tiered", "--conversation-cache-dir", folder, "--conversation-cache-min-free-mib", "0"]
    server = start_strata(flags)
    base = server.base
    model = _get(base, "/v1/models")[1]["data"][0]["id"]
    rng = random.Random(11)
    convs = [[{"role": "user", "content": f"Conversation {i}. " + filler(rng.randint(300, 800), i)
               + "\nSum this up in one line."}] for i in range(args.conversations)]
    stop, killed = threading.Event(), threading.Event()
    lock = threading.Lock()
    done: list[float] = []
    failures: dict[str, int] = {}
    probes: list[float] = []

    def client(i: int) -> None:
        api = OpenAI(base_url=base + "/v1", api_key="none", timeout=120, max_retries=0)
        mine = list(range(i, args.conversations, args.clients))
        turn = 0
        while not stop.is_set():
            conv = convs[mine[turn % len(mine)]]
            turn += 1
            t0 = time.perf_counter()
            try:
                reply = api.chat.completions.create(model=model, messages=conv, max_tokens=16, temperature=0)
            except Exception as exc:  # noqa: BLE001 - every failure is counted by kind
                with lock:
                    # a request in flight when the server is killed is cut, not a failure of the load
                    name = "cut by the kill" if killed.is_set() else type(exc).__name__
                    failures[name] = failures.get(name, 0) + 1
                time.sleep(1)
                continue
            with lock:
                done.append(time.perf_counter() - t0)
            conv += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                     {"role": "user", "content": f"And point {turn}?"}]

    def probe() -> None:
        while not stop.wait(2):
            for path in ("/metrics", "/cache/conversations"):
                try:
                    seconds, _ = _get(base, path)
                    probes.append(seconds)
                except OSError:
                    probes.append(float("inf"))

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
    threads.append(threading.Thread(target=probe, daemon=True))
    t_start = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(args.seconds)
    stop.set()
    listed = _get(base, "/cache/conversations")[1]["conversations"]
    on_disk = {r["id"] for r in listed if r["tier"] == "disk" and r["on_disk"]}
    killed.set()
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait()
    elapsed = time.perf_counter() - t_start
    for t in threads:
        t.join(timeout=130)
    t0 = time.perf_counter()
    again = start_strata(flags)
    restart_s = time.perf_counter() - t0
    found = {r["id"] for r in _get(again.base, "/cache/conversations")[1]["conversations"]}
    again.stop()
    return {
        "clients": args.clients, "conversations": args.conversations, "parallel": args.parallel,
        "seconds": round(elapsed, 1), "completed": len(done), "failed": failures,
        "latency_s": {"p50": _pct(done, 0.5), "p95": _pct(done, 0.95),
                      "mean": round(statistics.fmean(done), 3) if done else None},
        "probes": len(probes), "probe_s": {"p50": _pct(probes, 0.5), "p95": _pct(probes, 0.95),
                                            "max": max(probes) if probes else None},
        "listed_before_kill": len(listed), "on_disk_before_kill": len(on_disk),
        "restart_to_ready_s": round(restart_s, 1), "found_after_restart": len(found),
        "on_disk_lost": len(on_disk - found),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=180)
    parser.add_argument("--parallel", type=int, default=2)
    args = parser.parse_args(argv)
    print(f"# {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}", flush=True)
    print(json.dumps(run(args)), flush=True)
    print(f"# load at end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
