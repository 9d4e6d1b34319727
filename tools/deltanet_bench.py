"""The gated delta rule on CUDA: the PyTorch block scan (the reference) against fla-core's fused kernel.

    python tools/deltanet_bench.py [--tokens 16384] [--heads 32] [--dim 128]

1. One DeltaNet layer's prefill scan at Qwen3.5-9B's shape (32 value heads of 128 x 128), --tokens tokens from
   a random state: milliseconds of each path (median of 5 after a warm-up) and the fused output's and final
   state's relative difference from the reference.
2. A small random Qwen3.5 (tools/hybrid_switch_bench.py's, float32) served on cuda:0: the greedy tokens of a
   1,000-token prompt with the fused kernel and without, through the engine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from engine.model.hybrid import fla_kernels  # noqa: E402
from engine.model.hybrid.batch import segment_edges  # noqa: E402
from engine.model.hybrid.gated_deltanet import BLOCK, delta_rule_block, l2norm  # noqa: E402


def reference_scan(q, k, v, g, beta, state):
    out = torch.empty_like(v)
    lo = 0
    for edge in segment_edges(0, q.shape[0], BLOCK, []):
        blocks = (t[lo:edge].transpose(0, 1).contiguous() for t in (q, k, v, g, beta))
        o, state = delta_rule_block(*blocks, state)
        out[lo:edge] = o.transpose(0, 1)
        lo = edge
    return out, state


def median_ms(fn) -> float:
    fn()
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def kernel(n: int, heads: int, dim: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (n, heads, dim)
    q = l2norm(torch.randn(shape, device="cuda", generator=gen)) * dim**-0.5
    k = l2norm(torch.randn(shape, device="cuda", generator=gen))
    v = torch.randn(shape, device="cuda", generator=gen)
    g = -F.softplus(torch.randn(n, heads, device="cuda", generator=gen)) * 0.1
    beta = torch.rand(n, heads, device="cuda", generator=gen)
    s0 = torch.randn(heads, dim, dim, device="cuda", generator=gen) * 0.1
    ref_o, ref_s = reference_scan(q, k, v, g, beta, s0)
    fused_o, fused_s = fla_kernels.chunk(q, k, v, g, beta, s0)
    err_o = ((fused_o - ref_o).norm() / ref_o.norm()).item()
    err_s = ((fused_s - ref_s).norm() / ref_s.norm()).item()
    t_ref = median_ms(lambda: reference_scan(q, k, v, g, beta, s0))
    t_fused = median_ms(lambda: fla_kernels.chunk(q, k, v, g, beta, s0))
    print(f"delta rule, {n} tokens x {heads} heads of {dim}x{dim}: PyTorch blocks {t_ref:.1f} ms, fla-core "
          f"{t_fused:.1f} ms ({t_ref / t_fused:.1f}x); relative difference: output {err_o:.2e}, state {err_s:.2e}")


def tokens_both_ways() -> None:
    from engine.config import EngineConfig
    from engine.runtime.engine import Engine
    from engine.runtime.requests import GenerationRequest, SamplingParams
    from tools.hybrid_switch_bench import make_model

    with tempfile.TemporaryDirectory() as tmp:
        path = make_model("qwen3_5", os.path.join(tmp, "m"))
        prompt = torch.randint(3, 256, (1000,), generator=torch.Generator().manual_seed(3)).tolist()
        got = {}
        for fused in (False, True):
            fla_kernels.ENABLED = fused
            engine = Engine.from_config(EngineConfig(model=path, devices="cuda:0", dtype="float32", ctx_size=2048,
                                                     conversation_cache_mib=0))
            try:
                params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
                got[fused] = [e.token_id for e in engine.submit(GenerationRequest(f"t{fused}", prompt, params))
                              if e.token_id is not None]
            finally:
                engine.close()
        fla_kernels.ENABLED = True
        same = sum(a == b for a, b in zip(got[False], got[True], strict=True))
        print(f"greedy tokens after a 1000-token prompt (small Qwen3.5, float32): {same} of {len(got[True])} "
              f"identical with fla-core and without{'' if same == len(got[True]) else ': ' + str(got)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--dim", type=int, default=128)
    args = parser.parse_args(argv)
    if not fla_kernels.usable(torch.device("cuda")):
        raise SystemExit("needs a CUDA GPU and fla-core (pip install fla-core)")
    with torch.inference_mode():
        kernel(args.tokens, args.heads, args.dim)
    tokens_both_ways()
    return 0


if __name__ == "__main__":
    sys.exit(main())
