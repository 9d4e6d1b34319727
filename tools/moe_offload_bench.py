"""Prefill of a mixture-of-experts GGUF on a GPU with its routed experts in host RAM (`--moe-experts cpu`): the
experts run on the CPU for every chunk, or come to the GPU for a chunk of 32 rows or more (engine/model/moe_offload.py,
from the page-locked memory the loader registers), at each chunk size. One run, same process, same prompt.

    python tools/moe_offload_bench.py MODEL.gguf [--tokens 8192] [--chunks 512,2048] [--device cuda:0] [--threads 8]

Prints seconds per prefill of --tokens tokens for each variant and the ratio against the CPU experts'.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from engine.kv import KVBuffers, KVLayout  # noqa: E402
from engine.model import SeqChunk, load_model, moe_offload, plan_stages  # noqa: E402
from engine.model.loader import read_model_config  # noqa: E402


def prefill(lm, ids: torch.Tensor, chunk: int) -> float:
    c = lm.config
    kv = KVBuffers(KVLayout(c.n_layers, c.n_kv_heads, c.head_dim, lm.dtype), 1, len(ids) + 1, lm.model.stages)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for a in range(0, len(ids), chunk):
        lm.model.forward_chunks([SeqChunk(0, a, ids[a : a + chunk])], kv)
    torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--chunks", default="512,2048")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--threads", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n_layers = read_model_config(args.model).n_layers
    t = time.perf_counter()
    lm = load_model(args.model, plan_stages(n_layers, args.device, ""), torch.bfloat16,
                    cpu_experts=frozenset(range(n_layers)))
    print(f"loaded in {time.perf_counter() - t:.1f} s on {torch.cuda.get_device_name(0)}, {args.threads} threads")
    lm.model.batch_invariant = False  # `strata serve`'s default on a GPU (fast mode)
    ids = torch.randint(100, 20000, (args.tokens,))
    chunks = [int(x) for x in args.chunks.split(",")]
    results: dict[str, float] = {}
    default_min = moe_offload.OFFLOAD_MIN_ROWS
    prefill(lm, ids[:256], 128)  # warm-up: kernels, allocator
    moe_offload.OFFLOAD_MIN_ROWS = 1 << 30
    base_ids = ids[:2048]  # the CPU experts' rate from a shorter prompt: the whole one takes minutes
    base = len(base_ids) / prefill(lm, base_ids, 512)
    moe_offload.OFFLOAD_MIN_ROWS = default_min
    for chunk in chunks:
        results[f"offload, chunk {chunk}"] = prefill(lm, ids, chunk)
    print(f"{'cpu experts, chunk 512':32s} {args.tokens / base:8.2f} s  {base:8.0f} tok/s  (first 2048 tokens)")
    for name, secs in results.items():
        rate = args.tokens / secs
        print(f"{name:32s} {secs:8.2f} s  {rate:8.0f} tok/s  {rate / base:6.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
