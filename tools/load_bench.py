"""Load time and peak memory of a model load, each load in a fresh child process.

    python tools/load_bench.py [--model PATH] [--cpu-weights float|int4] [--moe-experts gpu|cpu] [--rounds 2]

The child imports the engine, notes its RSS (the baseline: Python, torch and the engine's modules), loads the
model as `strata serve` does on the CPU (float32; with int4 the projection weights end up as 4-bit groups), and
reports the wall time of the load, the peak RSS above the baseline (getrusage's high-water mark, so memory the
load held only for a moment counts too) and the bytes of the weights the model keeps. Peak / weights is the
figure the loader must keep under ~1.3. With `--moe-experts cpu` a mixture-of-experts model's routed experts
are built as 4-bit groups in host RAM, as `strata serve --moe-experts cpu` builds them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import inspect, json, resource, sys, time
import psutil, torch
from engine.model import int4, load_model, plan_stages
from engine.model.loader import read_model_config

path, weights, experts = sys.argv[1], sys.argv[2], sys.argv[3]
base = psutil.Process().memory_info().rss
t0 = time.perf_counter()
config = read_model_config(path)
stages = plan_stages(config.n_layers, "cpu", "")
direct = "int4_weights" in inspect.signature(load_model).parameters  # else an older loader: quantise after
kwargs = {"int4_weights": weights == "int4"} if direct else {}
if experts == "cpu":
    from engine.model import moe_placement
    kwargs["cpu_experts"] = moe_placement.cpu_expert_layers(config, "cpu", 0)
loaded = load_model(path, stages, torch.float32, **kwargs)
if weights == "int4" and not direct:
    int4.quantize_model(loaded.model)
seconds = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
model = loaded.model
kept = {}
for owner in model.modules():  # the layers and their expert blocks
    for name, value in list(vars(owner).items()) + list(owner._buffers.items()):
        for v in value if isinstance(value, list) else [value]:  # experts: one Int4Weight per expert
            if isinstance(v, (torch.Tensor, int4.Int4Weight)):
                kept[id(v)] = v.nbytes
print(json.dumps({"seconds": seconds, "baseline": base, "peak": peak, "weights": sum(kept.values()),
                  "rss_after": psutil.Process().memory_info().rss}))
"""


def measure(model: str, weights: str, experts: str = "gpu") -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", CHILD, model, weights, experts], capture_output=True, text=True,
                         env=env, check=False)
    if out.returncode != 0:
        raise SystemExit(f"load failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="GGUF file or HF folder (default: the bundled SmolLM2)")
    ap.add_argument("--cpu-weights", default="float", choices=("float", "int4"))
    ap.add_argument("--moe-experts", default="gpu", choices=("gpu", "cpu"),
                    help="cpu: a MoE model's routed experts as 4-bit groups in host RAM")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    model = args.model
    if not model:
        sys.path.insert(0, ROOT)
        from engine.model import embedded_model_path

        model = embedded_model_path()
    size = os.path.getsize(model) if os.path.isfile(model) else 0
    print(f"{os.path.basename(model)} ({size / 2**20:.0f} MiB file), --cpu-weights {args.cpu_weights}, "
          f"--moe-experts {args.moe_experts}, "
          f"{os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, load average {os.getloadavg()[0]:.1f}")
    runs = [measure(model, args.cpu_weights, args.moe_experts) for _ in range(args.rounds)]
    for r in runs:
        above = r["peak"] - r["baseline"]
        print(f"  load {r['seconds']:.2f} s   peak RSS {r['peak'] / 2**20:.0f} MiB (baseline {r['baseline'] / 2**20:.0f} "
              f"MiB, +{above / 2**20:.0f} MiB)   weights {r['weights'] / 2**20:.0f} MiB   "
              f"peak/weights {above / max(r['weights'], 1):.2f}   RSS after {r['rss_after'] / 2**20:.0f} MiB")
    best = min(runs, key=lambda r: r["seconds"])
    print(json.dumps({"best_seconds": round(best["seconds"], 2),
                      "peak_above_baseline_mib": round((best["peak"] - best["baseline"]) / 2**20),
                      "weights_mib": round(best["weights"] / 2**20)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
