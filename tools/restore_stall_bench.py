"""Does a disk restore stall another slot's stream? The longest gap between a streaming conversation's tokens
while a large parked conversation is restored from disk beside it.

A first `strata serve` parks conversation A (about --tokens prompt tokens) on disk; then, for each engine tree
given (--engine-path, default this checkout; e.g. an older tree for the before/after), a `--parallel 2` engine
on a copy of that folder streams conversation B (greedy, through the openai SDK) and, once B has produced
--lead tokens, A comes back (its files evicted from the page cache first, so the restore reads the disk). Printed
per run: A's time to first token, B's longest gap between tokens while A was being served, B's median gap
outside it, and the load average.

    python tools/restore_stall_bench.py --tokens 4000 --engine-path /tmp/old-tree --engine-path .
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.alternating_bench import Server, filler, free_port  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def serve(engine_path: str, flags: list[str]) -> Server:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.path.abspath(engine_path)}
    # -P: the working folder is not put before PYTHONPATH, so `engine` is the given tree's
    server = Server([sys.executable, "-P", "-m", "engine", "serve", "--port", str(port), *flags], env=env)
    server.wait_ready(port)
    return server


def client_of(server: Server) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=server.base + "/v1", api_key="none", timeout=900, max_retries=0)


def evict_page_cache(folder: str) -> None:
    """Drop the folder's file pages from the page cache (POSIX_FADV_DONTNEED), so the restore reads the disk."""
    for root, _, names in os.walk(folder):
        for name in names:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def one_run(engine_path: str, folder: str, flags: list[str], a_turn: list[dict], args: argparse.Namespace) -> dict:
    server = serve(engine_path, [*flags, "--parallel", "2", "--conversation-cache-dir", folder])
    try:
        client = client_of(server)
        arrivals: list[float] = []
        lead = threading.Event()

        def b_stream() -> None:
            stream = client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "Tell a long story about a lighthouse."}],
                max_tokens=args.b_tokens, temperature=0, stream=True, extra_body={"ignore_eos": True})
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    arrivals.append(time.perf_counter())
                    if len(arrivals) >= args.lead:
                        lead.set()
            lead.set()

        b = threading.Thread(target=b_stream)
        b.start()
        lead.wait()
        evict_page_cache(folder)
        t_send = time.perf_counter()
        load = os.getloadavg()[0]
        first = None
        usage = None
        for chunk in client.chat.completions.create(model="m", messages=a_turn, max_tokens=2, temperature=0,
                                                    stream=True, stream_options={"include_usage": True}):
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter()
            usage = chunk.usage or usage
        t_first = first or time.perf_counter()
        b.join()
    finally:
        server.stop()
        with open(server.log.name, errors="replace") as f:
            restored = [line.strip() for line in f if "conversation cache: restored" in line]
    gaps = list(zip(arrivals, arrivals[1:], strict=False))
    overlapping = [t1 - t0 for t0, t1 in gaps if t1 >= t_send and t0 <= t_first]  # gaps A's request overlaps
    outside = [t1 - t0 for t0, t1 in gaps if not (t1 >= t_send and t0 <= t_first)]
    details = getattr(usage, "prompt_tokens_details", None)
    return {"engine": engine_path, "a_ttft_s": t_first - t_send, "b_max_gap_during_s": max(overlapping, default=0.0),
            "b_median_gap_s": statistics.median(outside) if outside else float("nan"),
            "b_tokens_during": sum(1 for t in arrivals if t_send <= t <= t_first),
            "a_cached": getattr(details, "cached_tokens", 0) if details else 0,
            "a_prompt": usage.prompt_tokens if usage else 0, "load": load, "log": restored[-1:]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4000, help="prompt tokens of the parked conversation A")
    parser.add_argument("--b-tokens", type=int, default=200, help="tokens B streams")
    parser.add_argument("--lead", type=int, default=20, help="B's tokens before A comes back")
    parser.add_argument("--engine-path", action="append", help="engine tree to run (repeat; default this one)")
    parser.add_argument("--rounds", type=int, default=1, help="runs per engine tree, interleaved")
    parser.add_argument("--verbose", action="store_true", help="print each run's restore log line")
    args = parser.parse_args(argv)
    paths = args.engine_path or [REPO]
    ctx = args.tokens + 512
    flags = ["--ctx-size", str(ctx), "--conversation-cache-storage", "disk", "--conversation-cache-min-free-mib", "0"]
    a_first = [{"role": "system", "content": "Archive notes: " + filler(int(args.tokens * 0.75), 3)},
               {"role": "user", "content": "Summarise the notes in one line."}]
    with tempfile.TemporaryDirectory() as tmp:
        parked = os.path.join(tmp, "parked")
        server = serve(paths[-1], [*flags, "--parallel", "1", "--conversation-cache-dir", parked])
        try:
            reply = client_of(server).chat.completions.create(model="m", messages=a_first, max_tokens=4,
                                                              temperature=0)
        finally:
            server.stop()  # a clean shutdown parks A on disk
        a_turn = a_first + [{"role": "assistant", "content": reply.choices[0].message.content},
                            {"role": "user", "content": "And the second line?"}]
        size = sum(os.path.getsize(os.path.join(r, n)) for r, _, ns in os.walk(parked) for n in ns)
        print(f"A parked: {reply.usage.prompt_tokens} prompt tokens, {size / 2**20:.0f} MiB on disk", flush=True)
        print("| engine | A's TTFT | B's longest gap during A | B's median gap otherwise | B tokens during A | "
              "A cached/prompt | load (1 min) |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in range(args.rounds):
            for i, path in enumerate(paths):
                folder = os.path.join(tmp, f"run-{r}-{i}")
                shutil.copytree(parked, folder)
                row = one_run(path, folder, flags, a_turn, args)
                print(f"| {path} | {row['a_ttft_s']:.3f} s | {row['b_max_gap_during_s']:.3f} s | "
                      f"{row['b_median_gap_s']:.3f} s | {row['b_tokens_during']} | {row['a_cached']}/{row['a_prompt']} "
                      f"| {row['load']:.2f} |", flush=True)
                if args.verbose:
                    print("  engine log: " + " ".join(row["log"]), flush=True)
                shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
