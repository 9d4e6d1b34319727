"""Concurrent streams through a real `strata serve --parallel N`: aggregate decode tok/s as clients see it.

    python tools/serve_parallel_bench.py --model DIR [--devices cuda:0] [--streams 8] [--tokens 256] [-- FLAGS...]

Starts `strata serve --model DIR --devices D --parallel N` (plus FLAGS after `--`), warms it up with one round
like the measured ones (the decode graphs of every batch bucket and attention length are captured then), then N threads each stream one
chat completion through the `openai` SDK at once (greedy, `ignore_eos`, --tokens new tokens, distinct ~100-token
prompts). Printed: the aggregate rate over the whole round (completion tokens over the wall time from the first
request to the last token), the sum of each stream's own rate (its completion tokens over the time from its request to its
last chunk), and the time to each stream's first chunk.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools.alternating_bench import filler, start_strata  # noqa: E402


def one_round(base: str, streams: int, tokens: int, seed: int) -> list[dict]:
    """N streams at once; per stream: the request's start, each content chunk's arrival, completion tokens."""
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="none", timeout=600, max_retries=0)
    model = client.models.list().data[0].id
    barrier = threading.Barrier(streams)
    out: list[dict] = [{} for _ in range(streams)]

    def stream(i: int) -> None:
        messages = [{"role": "user", "content": f"Stream {i}. " + filler(20, seed * 100 + i)}]
        barrier.wait()
        start, arrivals, used = time.perf_counter(), [], 0
        response = client.chat.completions.create(
            model=model, messages=messages, max_tokens=tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        for chunk in response:
            # Every chunk's arrival: a random-weight model's tokens often decode to no text (ids outside the
            # byte tokenizer), so content chunks alone undercount; the usage chunk closes the stream.
            arrivals.append(time.perf_counter())
            if chunk.usage is not None:
                used = chunk.usage.completion_tokens
        out[i] = {"start": start, "arrivals": arrivals, "tokens": used}

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def summarise(rows: list[dict]) -> dict:
    start = min(r["start"] for r in rows)
    end = max(r["arrivals"][-1] for r in rows)
    total = sum(r["tokens"] for r in rows)
    # Each stream's own rate (its tokens over the time from its request to its last chunk), summed: the rate
    # of the streams running together, each one's wait for the others' prefill included.
    decoding = sum(r["tokens"] / (r["arrivals"][-1] - r["start"]) for r in rows)
    return {"tokens": total, "aggregate": total / (end - start), "steady": decoding,
            "ttft": [r["arrivals"][0] - r["start"] for r in rows if r["arrivals"]]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--devices", default="cuda:0")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2, help="measured rounds (the best is printed)")
    parser.add_argument("flags", nargs="*", help="more `strata serve` flags (after --)")
    args = parser.parse_args(argv)
    flags = ["--model", args.model, "--devices", args.devices, "--parallel", str(args.streams),
             "--ctx-size", str(max(1024, args.tokens + 512)), "--log-level", "warning", *args.flags]
    t = time.perf_counter()
    server = start_strata(flags)
    print(f"strata serve {' '.join(flags)}: ready in {time.perf_counter() - t:.1f} s", flush=True)
    try:
        # Warm-up as long as the rounds: graphs of longer attention lengths are captured on first use.
        one_round(server.base, args.streams, args.tokens, seed=0)
        results = [summarise(one_round(server.base, args.streams, args.tokens, seed=r + 1)) for r in range(args.rounds)]
    finally:
        server.stop()
    for r in results:
        print(f"{args.streams} streams x {args.tokens} tokens: {r['tokens']} tokens, aggregate {r['aggregate']:.1f} tok/s, "
              f"summed stream rates {r['steady']:.1f} tok/s, first chunk median "
              f"{statistics.median(r['ttft']) * 1e3:.0f} ms (max {max(r['ttft']) * 1e3:.0f} ms)", flush=True)
    best = max(results, key=lambda r: r["aggregate"])
    print(f"best: aggregate {best['aggregate']:.1f} tok/s, summed stream rates {best['steady']:.1f} tok/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
