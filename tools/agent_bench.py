"""Agents with subagents on one engine: does the parent's final turn come back from the cache?

S agent sessions run at once through the official `openai` SDK (streaming, greedy) against a real `strata serve`
child. Each grows a main context turn by turn (the warm turns), spawns K subagents (cold windows of their own,
run at once, two turns each), then returns to the main context for a final turn. Per session it prints the final
turn's reused fraction (cached / prompt tokens), its time to first token against the median of the session's own
warm turns, and, from GET /cache/requests, why the final turn computed what it did. The workload runs twice:
without priorities, then with `strata_priority` high for parents and low for subagents (metadata and the
X-Strata-Priority header). With --llama-server PATH (or $LLAMA_SERVER) it also runs on llama.cpp's server with
the same GGUF (the bundled model's file unless --model): its own prompt cache (`--cache-ram` = --cache-mib, idle
slots saved to it, `--cache-reuse` = --llama-cache-reuse), one slot per --parallel, and prints both side by side:
per session whether the final turn was reused and its time to first token. (llama-server's `--slot-save-path`
saves and restores slots only when asked through its /slots API, which an OpenAI client never does, so it is
not used.)

    python tools/agent_bench.py --sessions 2 --subagents 2 --main-tokens 1024 --sub-tokens 512 --parallel 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import urllib.request
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.alternating_bench import Server, filler, free_port, start_strata  # noqa: E402

MODES = (("none", "no priorities"), ("priorities", "parent high, subagents low"))


def turn(client: Any, model: str, messages: list[dict], max_tokens: int, priority: str | None) -> dict:
    """One streamed turn: seconds to the first token, the reply, prompt and cached tokens, the request id."""
    extra: dict[str, Any] = {}
    if priority is not None:
        extra = {"metadata": {"strata_priority": priority}, "extra_headers": {"X-Strata-Priority": priority}}
    t0 = time.perf_counter()
    first, text, usage, request_id, timings = None, "", None, "", None
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                            stream=True, stream_options={"include_usage": True}, **extra)
    for chunk in stream:
        request_id = request_id or chunk.id
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - t0
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            usage = chunk.usage
        timings = getattr(chunk, "timings", None) or timings  # llama-server's own figures (cache_n: reused)
    details = getattr(usage, "prompt_tokens_details", None)
    cached = (getattr(details, "cached_tokens", 0) or 0) if details else 0
    if not cached and isinstance(timings, dict):
        cached = int(timings.get("cache_n") or 0)
    prompt = usage.prompt_tokens if usage is not None else 0
    return {"s": first if first is not None else time.perf_counter() - t0, "text": text, "prompt": prompt,
            "cached": cached, "id": request_id}


def session(client: Any, model: str, i: int, args: argparse.Namespace, use_priorities: bool) -> dict:
    """One agent: warm turns on its main context, K cold subagents at once, then the final main turn."""
    parent = "high" if use_priorities else None
    child = "low" if use_priorities else None
    main = [{"role": "system", "content": f"Agent {i}. Project notes: " + filler(int(args.main_tokens * 0.75), i)},
            {"role": "user", "content": "Plan the change in one sentence."}]
    warm: list[float] = []
    for t in range(args.turns):
        r = turn(client, model, main, args.max_tokens, parent)
        if t > 0:
            warm.append(r["s"])
        main += [{"role": "assistant", "content": r["text"]}, {"role": "user", "content": f"Step {t + 2}: go on."}]

    def subagent(k: int) -> None:
        conv = [{"role": "system", "content": f"Subagent {i}.{k}. Files: "
                 + filler(int(args.sub_tokens * 0.75), 1000 + 10 * i + k)},
                {"role": "user", "content": "Find the function to change."}]
        r = turn(client, model, conv, args.max_tokens, child)
        conv += [{"role": "assistant", "content": r["text"]}, {"role": "user", "content": "And its callers?"}]
        turn(client, model, conv, args.max_tokens, child)

    threads = [threading.Thread(target=subagent, args=(k,)) for k in range(args.subagents)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    final = turn(client, model, main, args.max_tokens, parent)
    return {"session": i, "warm_s": warm, "final_s": final["s"], "final_prompt": final["prompt"],
            "final_cached": final["cached"], "final_id": final["id"]}


def run(server: Server, args: argparse.Namespace, use_priorities: bool) -> list[dict]:
    from openai import OpenAI

    client = OpenAI(base_url=server.base + "/v1", api_key="none", timeout=600, max_retries=0)
    model = client.models.list().data[0].id
    results: list[dict] = [{} for _ in range(args.sessions)]

    def one(i: int) -> None:
        results[i] = session(client, model, i, args, use_priorities)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(args.sessions)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if any(not r for r in results):
        raise RuntimeError("a session failed; see the error above")
    return results


def explained(server: Server, results: list[dict]) -> None:
    """Add each final turn's reason and source from GET /cache/requests (Strata only)."""
    with urllib.request.urlopen(server.base + "/cache/requests", timeout=10) as r:
        records = {rec["request_id"]: rec for rec in json.loads(r.read())["requests"]}
    for res in results:
        rec = records.get(res["final_id"], {})
        res["final_source"], res["final_reason"] = rec.get("source", "?"), rec.get("reason", "?")


def priorities_kept(server: Server) -> bool:
    """Whether the engine stored the priorities sent (an engine without them lists every conversation normal)."""
    with urllib.request.urlopen(server.base + "/cache/conversations", timeout=10) as r:
        rows = json.loads(r.read())["conversations"]
    return any(row.get("priority", "normal") != "normal" for row in rows)


def report(label: str, results: list[dict]) -> None:
    print(f"\n{label}")
    print("| session | final turn reused | final TTFT | warm TTFT (median) | final / warm | source | reason |")
    print("| ---: | ---: | ---: | ---: | ---: | --- | --- |")
    for r in results:
        warm = statistics.median(r["warm_s"]) if r["warm_s"] else float("nan")
        share = r["final_cached"] / r["final_prompt"] if r["final_prompt"] else 0.0
        print(f"| {r['session']} | {share:.0%} ({r['final_cached']}/{r['final_prompt']}) | {r['final_s']:.3f} s | "
              f"{warm:.3f} s | {r['final_s'] / warm:.1f}x | {r.get('final_source', '–')} | "
              f"{r.get('final_reason', '–')} |", flush=True)


def side_by_side(label: str, ours: list[dict], theirs: list[dict]) -> None:
    """Per session: the final turn's reused fraction and TTFT on Strata and on llama-server."""
    print(f"\n{label}")
    print("| session | Strata: final reused | Strata: final TTFT | llama.cpp: final reused | llama.cpp: final TTFT |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for a, b in zip(ours, theirs, strict=True):
        def share(r: dict) -> str:
            return f"{r['final_cached'] / r['final_prompt']:.0%}" if r["final_prompt"] else "–"
        print(f"| {a['session']} | {share(a)} | {a['final_s']:.3f} s | {share(b)} | {b['final_s']:.3f} s |",
              flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=2, help="agent sessions at once")
    parser.add_argument("--turns", type=int, default=3, help="main-context turns before the subagents (>= 2)")
    parser.add_argument("--subagents", type=int, default=2, help="cold subagent windows per session")
    parser.add_argument("--main-tokens", type=int, default=1024, help="prompt tokens of each main context")
    parser.add_argument("--sub-tokens", type=int, default=512, help="prompt tokens of each subagent window")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--parallel", type=int, default=2, help="engine slots")
    parser.add_argument("--cache-mib", type=int, default=160,
                        help="--conversation-cache-mib: small enough that subagents compete with their parents")
    parser.add_argument("--model", default="")
    parser.add_argument("--engine-args", default="", help="extra `strata serve` flags")
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER", ""))
    parser.add_argument("--llama-cache-reuse", type=int, default=256,
                        help="llama-server --cache-reuse: the least tokens of a chunk it shifts to reuse")
    parser.add_argument("--llama-args", default="", help="extra llama-server flags (e.g. \"--poll 0\")")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    if args.turns < 2:
        parser.error("--turns: expected at least 2 (the warm turns are the ones after the first)")
    ctx = 2 * (args.main_tokens + 64 * args.turns + 256)
    flags = ["--ctx-size", str(ctx), "--parallel", str(args.parallel), "--conversation-cache-mib",
             str(args.cache_mib), "--conversation-cache-min-free-mib", "0", *args.engine_args.split()]
    if args.model:
        flags += ["--model", args.model]
    print(f"strata serve {' '.join(flags)}; {args.sessions} sessions x ({args.turns} main turns of "
          f"~{args.main_tokens} tokens, {args.subagents} subagents of ~{args.sub_tokens} tokens, 1 final turn)",
          flush=True)
    out: dict[str, Any] = {"args": vars(args)}
    for mode, label in MODES:
        server = start_strata(flags)
        try:
            t0 = time.perf_counter()
            results = run(server, args, use_priorities=mode == "priorities")
            explained(server, results)
            kept = priorities_kept(server) if mode == "priorities" else None
        finally:
            server.stop()
        note = "" if kept in (None, True) else " — this engine does not keep priorities: the same as without"
        report(f"Strata, {label} ({time.perf_counter() - t0:.0f} s){note}", results)
        out[mode] = {"results": results, "priorities_kept": kept}
    if args.llama_server:
        from engine.model.loader import embedded_model_path

        port = free_port()
        argv = [args.llama_server, "-m", args.model or embedded_model_path(), "--port", str(port), "-c",
                str(ctx * args.parallel), "-np", str(args.parallel), "--cache-ram", str(args.cache_mib),
                "--cache-reuse", str(args.llama_cache_reuse), *args.llama_args.split()]
        print(" ".join(argv), flush=True)
        server = Server(argv)
        try:
            t0 = time.perf_counter()
            server.wait_ready(port)
            results = run(server, args, use_priorities=False)
        finally:
            server.stop()
        report(f"llama.cpp server (prompt cache, --cache-reuse {args.llama_cache_reuse}; "
               f"{time.perf_counter() - t0:.0f} s)", results)
        out["llama"] = {"results": results}
        for mode, label in MODES:
            side_by_side(f"Strata ({label}) beside llama.cpp", out[mode]["results"], results)
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
