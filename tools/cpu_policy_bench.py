"""Decode speed of a SmolLM2-135M-shaped 4-bit step under OpenMP wait policies, threads, and a busy core.

    python tools/cpu_policy_bench.py [--cores 0,1] [--tokens 32] [--rounds 4]

Plain torch, no engine and no model file (so it runs wherever torch has the CPU int4 kernels): 30 layers of
the bundled model's shapes (q/k/v, o, gate/up, down as int4 groups of 32, RMSNorm, attention over 100+ cached
positions) and the 49K-row output matrix, random weights. Each configuration runs in a child process pinned to
--cores, because the OpenMP runtime reads OMP_WAIT_POLICY only when torch loads; "busy" adds a pure-Python
busy loop pinned to the last of those cores for the whole measurement. Prints tokens/s per round.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

CONFIGS = [  # (label, OMP threads, OMP_WAIT_POLICY or None for the runtime's default)
    ("2 threads, default policy", 2, None),
    ("2 threads, PASSIVE", 2, "PASSIVE"),
    ("1 thread", 1, None),
]


def child(tokens: int, rounds: int) -> None:
    import torch
    import torch.nn.functional as F

    ops = torch.ops.aten
    torch.manual_seed(0)

    def packed(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        codes = torch.randint(0, 16, (n, k), dtype=torch.int32)
        return ops._convert_weight_to_int4pack_for_cpu(codes, 1), torch.rand(k // 32, n, 2).bfloat16()

    def mm(x: torch.Tensor, w: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return ops._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), w[0], 32, w[1]).float()

    layers = [(packed(960, 576), packed(576, 576), packed(3072, 576), packed(576, 1536)) for _ in range(30)]
    head = packed(49152, 576)
    k_cache, v_cache = torch.zeros(30, 512, 3, 64), torch.zeros(30, 512, 3, 64)
    norm_w = torch.ones(576)

    def step(pos: int) -> int:
        x = torch.randn(1, 576)
        for i, (wqkv, wo, w_gate_up, w_down) in enumerate(layers):
            qkv = mm(F.rms_norm(x, (576,), norm_w, 1e-5), wqkv)
            q = qkv[:, :576].view(3, 3, 64)
            k_cache[i, pos] = qkv[:, 576:768].view(3, 64)
            v_cache[i, pos] = qkv[:, 768:].view(3, 64)
            scores = torch.softmax(torch.bmm(q, k_cache[i, : pos + 1].permute(1, 2, 0)), -1)
            x = x + mm(torch.bmm(scores, v_cache[i, : pos + 1].transpose(0, 1)).reshape(1, 576), wo)
            gate_up = mm(F.rms_norm(x, (576,), norm_w, 1e-5), w_gate_up)
            x = x + mm(F.silu(gate_up[:, :1536]) * gate_up[:, 1536:], w_down)
        return int(mm(x, head).argmax())

    def rate(n: int) -> float:
        t = time.perf_counter()
        for pos in range(100, 100 + n):
            step(pos)
        return n / (time.perf_counter() - t)

    with torch.inference_mode():
        rate(8)
        print(" ".join(f"{rate(tokens):.1f}" for _ in range(rounds)), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cores", default="0,1", help="CPU cores the runs are pinned to (taskset list)")
    parser.add_argument("--tokens", type=int, default=32, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per configuration")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.tokens, args.rounds)
        return 0
    cores = args.cores
    print(f"cores {cores}, ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', 'default')}")
    for busy in (False, True):
        hog = None
        if busy:
            hog = subprocess.Popen(["taskset", "-c", cores.split(",")[-1], sys.executable, "-c", "while True: pass"])
        try:
            for label, threads, policy in CONFIGS:
                env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
                env.pop("OMP_WAIT_POLICY", None)
                if policy:
                    env["OMP_WAIT_POLICY"] = policy
                cmd = ["taskset", "-c", cores, sys.executable, os.path.abspath(__file__), "--child",
                       "--tokens", str(args.tokens), "--rounds", str(args.rounds)]
                try:
                    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout).stdout
                except subprocess.TimeoutExpired:
                    out = f"(over {args.timeout:.0f} s)"
                print(f"{'busy core' if busy else 'idle':<10} {label:<28} tok/s: {out.strip()}", flush=True)
        finally:
            if hog is not None:
                hog.kill()
                hog.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
