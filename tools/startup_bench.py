"""Cold start of `strata serve`: time to listening and to ready, the start-up phases, and the ready server's RSS.

    python tools/startup_bench.py [--model PATH] [--rounds 3] [-- EXTRA SERVE FLAGS]

Each round spawns `python -m engine serve --port 0 --conversation-cache-mib 0` (the cache off, so RSS is the
model, the runtime and the K/V), waits for `GET /health` to answer 200, notes the server's `start-up phases:`
log line and its RSS (psutil: resident set, and unique set size, the memory only this process holds), then
stops it. The page cache is warm after the first round (the figures the issue's target is about).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
import urllib.request

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _one(model: str, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "engine", "serve", "--port", "0", "--conversation-cache-mib", "0", *extra]
    if model:
        cmd += ["--model", model]
    env = {**os.environ, "PYTHONPATH": ROOT}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdin=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    assert proc.stderr is not None
    url, listening, phases, lines = "", 0.0, "", []
    try:
        while not url:
            line = proc.stderr.readline()
            if not line:
                raise RuntimeError("the server exited before listening:\n" + "".join(lines[-20:]))
            lines.append(line)
            if m := re.search(r"listening on (http://\S+)", line):
                url, listening = m.group(1), time.perf_counter() - t0
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.05)
        ready = time.perf_counter() - t0
        os.set_blocking(proc.stderr.fileno(), False)
        time.sleep(0.3)
        lines += proc.stderr.readlines()
        phases = next((ln.split("start-up phases: ", 1)[1].strip() for ln in lines if "start-up phases" in ln), "")
        info = psutil.Process(proc.pid).memory_full_info()
        return {"listening_s": round(listening, 2), "ready_s": round(ready, 2), "phases": phases,
                "rss_mib": round(info.rss / 2**20), "uss_mib": round(info.uss / 2**20)}
    finally:
        # Closing stdin is the engine's clean stop before and after it listens; terminate() would be
        # TerminateProcess on Windows, a crash.
        proc.stdin.close()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="model path (default: the bundled model)")
    parser.add_argument("--rounds", type=int, default=3)
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    for i in range(args.rounds):
        print(json.dumps({"round": i, **_one(args.model, extra)}), flush=True)
    print(f"# load at end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
