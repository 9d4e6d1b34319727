"""Conversations taking turns over HTTP, with the conversation cache off and on, in one run.

Two (or more) conversations of about N prompt tokens alternate for several rounds through the official `openai`
SDK against a real `strata serve` child. For each N it prints the follow-up time to first token (median) with
the cache off and on and their ratio, tokens reused, park/restore ms and MB/s from /metrics, and the engine's
RSS change per park; the machine's memory-copy rate (and, for disk modes, its fsync'd write and read rates) are
measured in the same run as the baselines. With --llama-server PATH (or $LLAMA_SERVER) the same workload runs on
llama.cpp's server with the same GGUF and our time over theirs is printed.

    python tools/alternating_bench.py --tokens 1024,2048,4096 [--storage ram|disk|tiered] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import psutil  # noqa: E402

WORDS = (
    "alpha river orchard lantern copper meadow violet harbour ember quartz willow canyon saffron tundra "
    "marble falcon juniper cobalt prairie thistle"
).split()


def filler(n_words: int, seed: int) -> str:
    out, x = [], seed * 7919 + 1
    for _ in range(n_words):
        x = (x * 1103515245 + 12345) % 2**31
        out.append(WORDS[x % len(WORDS)])
    return " ".join(out)


class Server:
    """A `strata serve` (or llama-server) child on a free port."""

    def __init__(self, argv: list[str], env: dict | None = None) -> None:
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)  # noqa: SIM115 - lives as long as the child
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.base = ""

    def wait_ready(self, port: int, timeout: float = 300) -> None:
        self.base = f"http://127.0.0.1:{port}"
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                with open(self.log.name) as f:
                    raise RuntimeError(f"server exited: {f.read()[-2000:]}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.3)
        raise RuntimeError("server did not become ready")

    def metrics(self) -> dict:
        with urllib.request.urlopen(self.base + "/metrics", timeout=10) as r:
            return json.loads(r.read())

    def rss(self) -> int:
        p = psutil.Process(self.proc.pid)
        return p.memory_info().rss + sum(c.memory_info().rss for c in p.children(recursive=True))

    def stop(self) -> None:
        """Ask the server to stop (POST /shutdown) and wait for its own exit: a strata engine parks and spills its
        cache first. Never terminate(): on Windows that is TerminateProcess, a crash. A server that refuses the
        request (llama-server has no such route) keeps nothing to save and is killed after a short wait."""
        try:
            self.proc.wait(timeout=90 if self._ask_shutdown() else 5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _ask_shutdown(self) -> bool:
        """False when the server answered the request with an error; True when it accepted it, or the
        connection dropped because it is stopping already."""
        if not self.base:
            return False
        try:
            with urllib.request.urlopen(urllib.request.Request(self.base + "/shutdown", method="POST"), timeout=10):
                return True
        except urllib.error.HTTPError:
            return False
        except OSError:
            return True


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_strata(extra: list[str]) -> Server:
    port = free_port()
    server = Server([sys.executable, "-m", "engine", "serve", "--port", str(port), *extra])
    server.wait_ready(port)
    return server


def ttft(client, model: str, messages: list[dict], max_tokens: int) -> tuple[float, str, int]:
    """Seconds to the first streamed token, the reply text, and cached prompt tokens."""
    t0 = time.perf_counter()
    first = None
    text = ""
    cached = 0
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - t0
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            details = getattr(chunk.usage, "prompt_tokens_details", None)
            cached = (getattr(details, "cached_tokens", 0) or 0) if details else 0
    return (first if first is not None else time.perf_counter() - t0), text, cached


def alternate(server: Server, n_tokens: int, n_convs: int, rounds: int, max_tokens: int) -> dict:
    """Run the workload; returns follow-up TTFTs, reuse and the RSS seen after each park."""
    from openai import OpenAI

    client = OpenAI(base_url=server.base + "/v1", api_key="none")
    model = client.models.list().data[0].id
    words = max(16, int(n_tokens * 0.75))
    convs = [[{"role": "system", "content": f"Conversation {i}. " + filler(words, i)},
              {"role": "user", "content": "Summarise the text above in one sentence."}] for i in range(n_convs)]
    follow_ups, cached, rss, first_turns = [], [], [], []
    for r in range(rounds):
        for conv in convs:
            t, text, c = ttft(client, model, conv, max_tokens)
            if r > 0:
                follow_ups.append(t)
                cached.append(c)
            else:
                first_turns.append(t)
            rss.append(server.rss())
            conv += [{"role": "assistant", "content": text}, {"role": "user", "content": f"And point {r + 2}?"}]
    return {"follow_up_s": follow_ups, "cached": cached, "rss": rss, "model": model, "first_s": first_turns,
            "convs": convs}


def resume_after_restart(flags: list[str], convs: list[list[dict]], max_tokens: int) -> tuple[float, int]:
    """Start a fresh engine on the same cache folder and time conversation 0's next turn."""
    from openai import OpenAI

    server = start_strata(flags)
    try:
        client = OpenAI(base_url=server.base + "/v1", api_key="none")
        model = client.models.list().data[0].id
        t, _, c = ttft(client, model, convs[0], max_tokens)
        return t, c
    finally:
        server.stop()


def memcpy_gbps() -> float:
    import torch

    src = torch.empty(256 * 2**20, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    best = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = max(best, src.numel() / (time.perf_counter() - t0) / 1e9)
    return best


def disk_gbps(folder: str, size_mib: int = 512) -> tuple[float, float]:
    """Sequential write (with fsync) and read rate of `folder`, in GB/s (read may be page-cache hot)."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "bench-io.tmp")
    block = os.urandom(8 * 2**20)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(size_mib // 8):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    write = size_mib * 2**20 / (time.perf_counter() - t0) / 1e9
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(8 * 2**20):
            pass
    read = size_mib * 2**20 / (time.perf_counter() - t0) / 1e9
    os.remove(path)
    return write, read


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1024,2048,4096", help="prompt tokens per conversation, comma-separated")
    parser.add_argument("--conversations", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--storage", choices=("ram", "disk", "tiered"), default="ram")
    parser.add_argument("--model", default="")
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER", ""))
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--engine-args", default="", help="extra `strata serve` flags for the cache-on engine")
    parser.add_argument("--serve-args", default="",
                        help="`strata serve` flags for both engines (e.g. \"--devices cuda:0 --moe-experts cpu\")")
    args = parser.parse_args(argv)
    sizes = [int(x) for x in args.tokens.split(",")]
    ctx = max(sizes) * 2 + 1024

    tmp = tempfile.mkdtemp(prefix="strata-bench-")
    base = ["--ctx-size", str(ctx), "--conversation-cache-min-free-mib", "0", "--log-level", "warning"]
    if args.model:
        base += ["--model", args.model]
    base += args.serve_args.split()
    results: dict = {"storage": args.storage, "memcpy_gbps": memcpy_gbps()}
    print(f"memory copy: {results['memcpy_gbps']:.1f} GB/s")
    if args.storage != "ram":
        w, r = disk_gbps(tmp)
        results.update(disk_write_gbps=w, disk_read_gbps=r)
        print(f"disk {tmp}: write+fsync {w:.2f} GB/s, read {r:.2f} GB/s")
    on_flags = base + ["--conversation-cache-storage", args.storage, "--conversation-cache-dir", os.path.join(tmp, "c"),
                       *args.engine_args.split()]
    off_flags = base + ["--conversation-cache-mib", "0"]

    rows = []
    for n in sizes:
        off = start_strata(off_flags)
        try:
            r_off = alternate(off, n, args.conversations, args.rounds, args.max_tokens)
        finally:
            off.stop()
        on = start_strata(on_flags)
        try:
            r_on = alternate(on, n, args.conversations, args.rounds, args.max_tokens)
            m = on.metrics()["conversation_cache"]
        finally:
            on.stop()
        row = {
            "tokens": n,
            "off_s": statistics.median(r_off["follow_up_s"]),
            "on_s": statistics.median(r_on["follow_up_s"]),
            "reused": statistics.median(r_on["cached"]),
            "park_ms": m.get("park_ms", {}).get("p50"),
            "restore_ms": m.get("restore_ms", {}).get("p50"),
            "bytes_parked": m.get("bytes_parked"),
            "bytes_restored": m.get("bytes_restored"),
            "parks": m.get("parks"),
            "restores": m.get("restores"),
            "rss_step_mib": max(b - a for a, b in zip(r_on["rss"], r_on["rss"][1:], strict=False)) / 2**20,
        }
        if row["restores"]:
            per = row["bytes_restored"] / row["restores"]
            row["restore_gbps"] = per / (row["restore_ms"] / 1000) / 1e9 if row["restore_ms"] else None
        if row["parks"]:
            per = row["bytes_parked"] / row["parks"]
            row["park_gbps"] = per / (row["park_ms"] / 1000) / 1e9 if row["park_ms"] else None
        if args.storage != "ram":
            # on.stop() was a clean shutdown: live slots and (tiered) the RAM tier are on disk now.
            row["restart_s"], row["restart_cached"] = resume_after_restart(on_flags, r_on["convs"], args.max_tokens)
            row["cold_s"] = statistics.median(r_off["first_s"])
            print(f"N={n}: first request after a restart {row['restart_s']:.3f} s "
                  f"({row['restart_cached']} tokens reused) vs cold prefill {row['cold_s']:.3f} s "
                  f"({row['cold_s'] / row['restart_s']:.1f}x)", flush=True)
        if args.llama_server:
            row["llama_s"] = run_llama(args, n, ctx)
        rows.append(row)
        ratio = row["off_s"] / row["on_s"] if row["on_s"] else float("inf")
        print(f"N={n}: follow-up TTFT off {row['off_s']:.3f} s, on {row['on_s']:.3f} s ({ratio:.1f}x); "
              f"reused {row['reused']:.0f} tokens; park p50 {row['park_ms']} ms ({_g(row.get('park_gbps'))}), "
              f"restore p50 {row['restore_ms']} ms ({_g(row.get('restore_gbps'))}); "
              f"largest RSS step {row['rss_step_mib']:.1f} MiB"
              + (f"; llama-server {row['llama_s']:.3f} s (ours/theirs {row['on_s'] / row['llama_s']:.2f})"
                 if row.get("llama_s") else ""), flush=True)
    results["rows"] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def _g(x: float | None) -> str:
    return f"{x:.2f} GB/s" if x else "n/a"


def run_llama(args, n: int, ctx: int) -> float | None:
    """The same workload on llama.cpp's server with the same GGUF and its host-RAM prompt cache."""
    from engine.model.loader import embedded_model_path

    port = free_port()
    model = args.model or embedded_model_path()
    srv = Server([args.llama_server, "-m", model, "--port", str(port), "-c", str(ctx), "-np", "1",
                  "--cache-ram", "4096"])
    try:
        srv.wait_ready(port)
        r = alternate(srv, n, args.conversations, args.rounds, args.max_tokens)
        return statistics.median(r["follow_up_s"])
    finally:
        srv.stop()


if __name__ == "__main__":
    sys.exit(main())
