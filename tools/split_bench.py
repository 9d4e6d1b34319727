"""Two long conversations taking turns on a layer-split model: follow-up prompt time with parking vs without.

Runs in-process (no HTTP). Conversations A and B of about --tokens prompt tokens each alternate for --turns
turns each, greedy, first with the conversation cache off and then on, on the same split. Prints the seed-002
style table: follow-ups resumed, follow-up prompt time (median), and park/restore milliseconds and bytes per
stage, next to the pinned host<->device copy bandwidth measured in the same run.

    python tools/split_bench.py --model DIR --devices cuda:0,cuda:0 --layer-split auto --tokens 11000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.runtime.engine import Engine  # noqa: E402
from engine.runtime.requests import GenerationRequest, SamplingParams  # noqa: E402

WORDS = ["harbour", "lantern", "orchard", "copper", "meadow", "quartz", "willow", "canyon", "saffron", "tundra"]


def text_of(n_chars: int, seed: int) -> str:
    out, x, size = [], seed + 1, 0
    while size < n_chars:
        x = (x * 1103515245 + 12345) % 2**31
        w = WORDS[x % len(WORDS)]
        out.append(w)
        size += len(w) + 1
    return " ".join(out)


def pinned_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> tuple[float, float]:
    """Host->device and device->host GB/s with pinned host memory."""
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev.copy_(host)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(3):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    h2d = 3 * nbytes / (time.perf_counter() - t0) / 1e9
    t0 = time.perf_counter()
    for _ in range(3):
        host.copy_(dev, non_blocking=True)
    torch.cuda.synchronize(device)
    d2h = 3 * nbytes / (time.perf_counter() - t0) / 1e9
    return h2d, d2h


def turn(engine: Engine, messages: list[dict], max_tokens: int) -> tuple[float, str, int, int]:
    """Prompt time (to the first token), reply, cached tokens, prompt tokens."""
    prompt = engine.tokenizer.encode(engine.tokenizer.render_chat(messages), add_special_tokens=False)
    t0 = time.perf_counter()
    stream = engine.submit(GenerationRequest(f"b{time.time_ns()}", prompt, SamplingParams(temperature=0.0,
                                                                                         max_tokens=max_tokens)))
    first, text, cached = None, "", 0
    for event in stream:
        if first is None and event.token_id is not None:
            first = time.perf_counter() - t0
        text += event.text
        if event.usage is not None:
            cached = event.usage.cached_tokens
    return first or (time.perf_counter() - t0), text, cached, len(prompt)


def run(config: EngineConfig, n_chars: int, turns: int, max_tokens: int) -> dict:
    engine = Engine.from_config(config)
    try:
        convs = [[{"role": "system", "content": f"Conversation {c}. " + text_of(n_chars, c)},
                  {"role": "user", "content": "Summarise."}] for c in range(2)]
        follow, resumed, prompt_tokens = [], 0, []
        before = [(s.read_s, s.read_bytes, s.write_s, s.write_bytes) for s in engine.kv.stages]
        for t in range(turns):
            for conv in convs:
                seconds, reply, cached, n = turn(engine, conv, max_tokens)
                prompt_tokens.append(n)
                if t > 0:
                    follow.append(seconds)
                    resumed += cached >= n // 2
                conv += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"Point {t + 2}?"}]
        stats = engine.call(engine.cache_stats).result()
        stages = []
        for (r0, rb0, w0, wb0), s in zip(before, engine.kv.stages, strict=True):
            stages.append({"device": str(s.device), "layers": f"{s.first_layer}-{s.end_layer - 1}",
                           "park_s": s.read_s - r0, "park_bytes": s.read_bytes - rb0,
                           "restore_s": s.write_s - w0, "restore_bytes": s.write_bytes - wb0})
        return {"follow_up_s": follow, "resumed": resumed, "n_follow_ups": len(follow), "stats": stats,
                "stages": stages, "prompt_tokens": max(prompt_tokens)}
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--devices", default="cuda:0,cuda:0")
    parser.add_argument("--layer-split", default="auto")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=11000, help="approximate prompt tokens per conversation")
    parser.add_argument("--chars-per-token", type=float, default=1.0, help="of the model's tokenizer")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--storage", default="ram", choices=("ram", "disk", "tiered"))
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    n_chars = int(args.tokens * args.chars_per_token)
    ctx = int(args.tokens * 1.3) + args.turns * 64 + 1024
    base = dict(model=args.model, devices=args.devices, layer_split=args.layer_split, dtype=args.dtype,
                ctx_size=ctx, conversation_cache_min_free_mib=0, prefill_chunk=2048)
    device = torch.device(args.devices.split(",")[0])
    h2d, d2h = pinned_bandwidth(device) if device.type == "cuda" else (float("nan"), float("nan"))
    print(f"pinned host->device {h2d:.1f} GB/s, device->host {d2h:.1f} GB/s", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        off = run(EngineConfig(**base, conversation_cache_mib=0), n_chars, args.turns, args.max_tokens)
        on = run(EngineConfig(**base, conversation_cache_mib=65536, conversation_cache_storage=args.storage,
                              conversation_cache_dir=tmp, conversation_cache_disk_mib=65536),
                 n_chars, args.turns, args.max_tokens)
    s = on["stats"]
    print(f"\n{args.devices} split {args.layer_split}, {on['prompt_tokens']} prompt tokens at most, "
          f"storage {args.storage}\n")
    print("| | follow-ups resumed | follow-up prompt time (median) |\n| --- | ---: | ---: |")
    print(f"| no parking | {off['resumed']} of {off['n_follow_ups']} | {statistics.median(off['follow_up_s']):.3f} s |")
    print(f"| parking | {on['resumed']} of {on['n_follow_ups']} | {statistics.median(on['follow_up_s']):.3f} s |")
    parks, restores = max(s.get("parks", 0), 1), max(s.get("restores", 0), 1)
    print(f"\nparks {s.get('parks')}, restores {s.get('restores')}; park ms p50 {s['park_ms']['p50']:.1f}, "
          f"restore ms p50 {s['restore_ms']['p50']:.1f}\n")
    print("| stage | device | layers | park ms (mean) | park MB | restore ms (mean) | restore MB | restore GB/s |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for i, st in enumerate(on["stages"]):
        gbps = st["restore_bytes"] / st["restore_s"] / 1e9 if st["restore_s"] else float("nan")
        print(f"| {i} | {st['device']} | {st['layers']} | {st['park_s'] / parks * 1000:.1f} | "
              f"{st['park_bytes'] / parks / 1e6:.0f} | {st['restore_s'] / restores * 1000:.1f} | "
              f"{st['restore_bytes'] / restores / 1e6:.0f} | {gbps:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"off": off, "on": on, "h2d_gbps": h2d, "d2h_gbps": d2h, "args": vars(args)}, f, indent=1,
                      default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
