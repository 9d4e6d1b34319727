"""Decode tokens/s with and without prompt lookup (`--spec prompt-lookup`) on an agent-like replay, in one run.

    python tools/spec_bench.py [--model PATH] [--rounds 3] [--max-tokens 256] [--draft-max 8]
    LLAMA_SERVER=/tmp/llama/bin/llama-server python tools/spec_bench.py --llama-spec none,ngram-simple,ngram-mod

The replay: the model is shown a source file (engine/runtime/stop_strings.py) and asked to repeat it with one edit,
as an agent re-emits a file it has just read. Each round runs the same greedy request on an engine without and one
with speculation, in turn (the two engines loaded side by side, so a shared machine's load falls on both alike);
the decode rate is the streamed tokens after the first over their time, the median of --rounds. The answers must
be token-identical (the tool exits 1 otherwise). With LLAMA_SERVER set, llama-server runs the same chat on the same
GGUF with each --llama-spec type (its `timings.predicted_per_second`, the median of --rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.cli import sleeping_cpu_workers  # noqa: E402 - torch-free; must run before torch loads

sleeping_cpu_workers()  # the OpenMP wait policy `strata serve` runs with

from engine.config import EngineConfig  # noqa: E402
from engine.runtime.engine import Engine  # noqa: E402
from engine.runtime.requests import GenerationRequest, SamplingParams  # noqa: E402
from tools.llama_cpp_compare import cpu_description, load, model_path  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILE = os.path.join(ROOT, "engine", "runtime", "stop_strings.py")


def replay_messages() -> list[dict]:
    with open(FILE, encoding="utf-8") as f:
        source = f.read()
    ask = (f"Here is engine/runtime/stop_strings.py:\n\n```python\n{source}```\n\nRepeat the whole file, with the "
           "class StopStringFilter renamed to StopFilter. Answer with the file only.")
    return [{"role": "user", "content": ask}]


def strata_decode(engine: Engine, messages: list[dict], max_tokens: int) -> tuple[float, list[int]]:
    """The decode rate (tokens after the first over their time) of one greedy answer, and its tokens."""
    tok = engine.tokenizer
    prompt = tok.encode(tok.render_chat(messages), add_special_tokens=False)
    stream = engine.submit(GenerationRequest(f"spec-bench-{time.monotonic_ns()}", prompt,
                                             SamplingParams(temperature=0.0, max_tokens=max_tokens)))
    tokens: list[int] = []
    first = last = 0.0
    for event in stream:
        assert event.error is None, event.error
        if event.token_id is not None:
            tokens.append(event.token_id)
            last = time.perf_counter()
            first = first or last
    return (len(tokens) - 1) / (last - first), tokens


def llama_decode(binary: str, gguf: str, spec: str, messages: list[dict], max_tokens: int, rounds: int,
                 draft_max: int, threads: int) -> tuple[list[float], int]:
    """llama-server's decode rate in each of `rounds` for spec type `spec` (one server throughout), and its answer's
    length. Its ngram-mod and ngram-cache types keep what they saw across requests, so a repeated request's later
    rounds draft from the earlier answers: the first round is the fresh figure."""
    port = 8791
    cmd = [binary, "-m", gguf, "--port", str(port), "-t", str(threads), "-c", "4096", "-np", "1", "--cache-ram", "0"]
    if spec != "none":
        cmd += ["--spec-type", spec, "--spec-draft-n-max", str(draft_max)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.1)
        rates, n = [], 0
        for _ in range(rounds):
            body = json.dumps({"messages": messages, "temperature": 0, "max_tokens": max_tokens,
                               "cache_prompt": False}).encode()
            req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as r:
                answer = json.load(r)
            rates.append(answer["timings"]["predicted_per_second"])
            n = answer["timings"]["predicted_n"]
        return rates, n
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="a GGUF file or HF folder (default: the bundled model)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--draft-max", type=int, default=8)
    p.add_argument("--llama-spec", default="none,ngram-simple",
                   help="llama-server --spec-type values to run (comma-separated) when LLAMA_SERVER is set")
    p.add_argument("--llama-threads", type=int, default=2, help="llama-server -t")
    p.add_argument("--devices", default="auto", help="the engines' --devices (auto: cuda:0 when there is a GPU)")
    args = p.parse_args(argv)
    gguf = model_path(args.model)
    messages = replay_messages()
    print(f"CPU: {cpu_description()}; load at start {load()}")
    base = EngineConfig(model=gguf if args.model else "", ctx_size=4096, conversation_cache_mib=0, devices=args.devices)
    import torch

    if base.devices != "cpu" and torch.cuda.is_available():
        print(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    engines = {"off": Engine.from_config(base),
               "prompt-lookup": Engine.from_config(base.replace(spec="prompt-lookup", spec_draft_max=args.draft_max))}
    rates: dict[str, list[float]] = {k: [] for k in engines}
    answers: dict[str, list[int]] = {}
    try:
        for _ in range(args.rounds):
            for key, engine in engines.items():
                rate, answers[key] = strata_decode(engine, messages, args.max_tokens)
                rates[key].append(rate)
        declined = engines["prompt-lookup"].scheduler.speculation.declined
        if declined:
            print(f"--spec prompt-lookup declined: {declined}")
        counters = engines["prompt-lookup"].stats.counters
        drafted, accepted = counters["spec_drafted_tokens"], counters["spec_accepted_tokens"]
    finally:
        for engine in engines.values():
            engine.close()
    off = statistics.median(rates["off"])
    on = statistics.median(rates["prompt-lookup"])
    print(f"strata --spec off:           {off:6.1f} tok/s decode ({len(answers['off'])} tokens; rounds "
          f"{', '.join(f'{r:.1f}' for r in rates['off'])})")
    print(f"strata --spec prompt-lookup: {on:6.1f} tok/s decode, {on / off:.2f}x; accepted {accepted} of {drafted} "
          f"drafted ({accepted / max(drafted, 1):.0%}); rounds {', '.join(f'{r:.1f}' for r in rates['prompt-lookup'])}")
    same = answers["off"] == answers["prompt-lookup"]
    print(f"answers token-identical: {same}")
    binary = os.environ.get("LLAMA_SERVER")
    if binary:
        for spec in args.llama_spec.split(","):
            rates_l, n = llama_decode(binary, gguf, spec, messages, args.max_tokens, args.rounds, args.draft_max,
                                      args.llama_threads)
            print(f"llama-server -t {args.llama_threads} --spec-type {spec:13s} {statistics.median(rates_l):6.1f} tok/s "
                  f"decode ({n} tokens; first round {rates_l[0]:.1f}, rounds "
                  f"{', '.join(f'{r:.1f}' for r in rates_l)})")
    print(f"load at end {load()}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
