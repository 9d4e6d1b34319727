"""GPU decode modes and K/V transfers on one loaded model, in one run (the figures of docs/BENCHMARKS.md):

    python tools/gpu_decode_bench.py --model DIR [--batches 1,8] [--tokens 128] [--restore-tokens 11000]
                                     [--gpu-weights bf16,int4]

- decode tok/s for each mode (`--deterministic`: per-row kernels, eagerly, as before; `--no-cuda-graphs`: one
  GEMM per projection, the captured step's function run eagerly; default: the same, replayed from CUDA graphs)
  at each batch size, against the HBM roofline measured in the same run (every weight byte read once per step);
- the greedy tokens of the captured steps against --no-cuda-graphs, same prompts, same batch;
- with `--gpu-weights bf16,int4`: the same model's weights then made 4-bit groups in place (engine.model.gpu_weights),
  both default modes again, the int4/bf16 ratio, a 2048-token prefill in each format, and the int4 logits' relative
  difference from bf16 over a prompt;
- restore and park of a --restore-tokens conversation, block by block as the cache moves it, through the pinned
  staging ring (one transfer per block, as before, and gathered), against a pinned host-to-device copy.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.kv import KVBuffers, KVLayout  # noqa: E402
from engine.model import SeqChunk, gpu_weights, load_model, plan_stages  # noqa: E402
from engine.model.graph_decode import configure  # noqa: E402
from engine.model.loader import read_model_config  # noqa: E402


def timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def decode(lm, kv: KVBuffers, prompts: list[torch.Tensor], n_new: int) -> tuple[float, list[list[int]]]:
    """Prefill each prompt into its slot, then decode all slots together greedily: (tok/s, tokens per slot)."""
    first = [int(lm.model.forward_chunks([SeqChunk(s, 0, p)], kv)[0].argmax()) for s, p in enumerate(prompts)]
    out = [[t] for t in first]

    def loop() -> None:
        tokens = first
        for step in range(n_new):
            chunks = [SeqChunk(s, len(p) + step, torch.tensor([t])) for s, (p, t) in enumerate(zip(prompts, tokens, strict=True))]
            tokens = lm.model.forward_chunks(chunks, kv).argmax(-1).tolist()
            for s, t in enumerate(tokens):
                out[s].append(t)

    seconds = timed(loop)
    return len(prompts) * n_new / seconds, out


def roofline(lm) -> tuple[float, float]:
    src = torch.randn(1 << 30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    gbps = 2 * src.nbytes / min(timed(lambda: dst.copy_(src)) for _ in range(5)) / 1e9
    read = sum(t.nbytes for t in lm.model.buffers()) - lm.model.embed.nbytes  # one embedding row per token
    return gbps, gbps * 1e9 / read


def transfers(lm, n_tokens: int, block: int = 64) -> list[tuple[str, float]]:
    """GB/s of a conversation's K/V moved block by block as the cache moves it, and of one pinned copy."""
    c = lm.config
    layout = KVLayout(c.n_layers, c.n_kv_heads, c.head_dim, lm.dtype)
    kv = KVBuffers(layout, 1, n_tokens, lm.model.stages)
    blocks = [torch.randn(layout.host_shape(block)).to(lm.dtype) for _ in range(n_tokens // block)]
    total = sum(b.nbytes for b in blocks)
    pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    device_copy = torch.empty(total, dtype=torch.uint8, device="cuda")
    seconds = min(timed(lambda: device_copy.copy_(pinned, non_blocking=True)) for _ in range(3))
    rows = [("pinned host->device copy", total / seconds / 1e9)]
    device_copy.resize_(0)

    def restore(per_block: bool) -> None:
        for i, b in enumerate(blocks):
            kv.write(0, i * block, b, wait=False)
            if per_block:
                kv.flush()  # one transfer per block, as before rows were gathered
        kv.synchronize()

    def park() -> None:
        for i, b in enumerate(blocks):
            kv.read(0, i * block, (i + 1) * block, out=b)

    for per_block, name in ((True, "restore, a transfer per block"), (False, "restore, gathered")):
        restore(per_block)
        rows.append((name, total / min(timed(lambda p=per_block: restore(p)) for _ in range(3)) / 1e9))
    expected = torch.cat(blocks, dim=2)
    assert torch.equal(kv.read(0, 0, len(blocks) * block), expected), "restored K/V differs from the host copy"
    rows.append(("park, block by block", total / min(timed(park) for _ in range(3)) / 1e9))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per slot")
    parser.add_argument("--restore-tokens", type=int, default=11000)
    parser.add_argument("--gpu-weights", default="bf16", help="formats to run in turn: bf16, or bf16,int4")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    t = time.perf_counter()
    lm = load_model(args.model, plan_stages(read_model_config(args.model).n_layers, "cuda:0", ""), torch.bfloat16)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, load {time.perf_counter() - t:.1f} s")
    gbps, roof = roofline(lm)
    print(f"HBM copy {gbps:.0f} GB/s -> decode roofline {roof:.0f} tok/s per step of one row")
    c = lm.config
    layout = KVLayout(c.n_layers, c.n_kv_heads, c.head_dim, lm.dtype)
    gen = torch.Generator().manual_seed(0)
    modes = [("deterministic (eager, per-row)", False, True), ("default, --no-cuda-graphs", False, False),
             ("default, CUDA graphs", True, False)]
    results: dict[tuple[str, int], float] = {}
    tokens: dict[tuple[str, int], list[list[int]]] = {}
    formats = args.gpu_weights.split(",")
    probe = torch.randint(0, c.vocab_size, (2048,), generator=gen)
    logits: dict[str, torch.Tensor] = {}
    prefill: dict[str, float] = {}
    names: list[str] = []
    for fmt in formats:
        if fmt == "int4":
            before, after = gpu_weights.quantize_model(lm.model)
            print(f"int4: {before / 2**30:.2f} GiB of projection weights as {after / 2**30:.2f} GiB")
        fmt_modes = [(f"{fmt}, {n}" if fmt != "bf16" else n, g, d) for n, g, d in modes if fmt == "bf16" or not d]
        names += [n for n, _, _ in fmt_modes]
        probe_kv = KVBuffers(layout, 1, probe.numel() + 8, lm.model.stages)
        configure(lm.model, 1, cuda_graphs=False, deterministic=False)

        def run(kv: KVBuffers = probe_kv, every: bool = False) -> torch.Tensor:
            out = lm.model.forward_chunks([SeqChunk(0, 0, probe)], kv, all_logits=every)
            return out[0] if every else out

        logits[fmt] = run(every=True).float()
        prefill[fmt] = probe.numel() / min(timed(run) for _ in range(3))
        del probe_kv
        for batch in batches:
            prompts = [torch.randint(0, c.vocab_size, (args.prompt,), generator=torch.Generator().manual_seed(batch))
                       for _ in range(batch)]
            kv = KVBuffers(layout, batch, args.prompt + args.tokens + 8, lm.model.stages)
            for name, graphs, deterministic in fmt_modes:
                configure(lm.model, batch, cuda_graphs=graphs, deterministic=deterministic)
                decode(lm, kv, prompts, 8)  # warm-up (and graph capture)
                best = 0.0
                for _ in range(2):
                    rate, out = decode(lm, kv, prompts, args.tokens)
                    best = max(best, rate)
                results[(name, batch)], tokens[(name, batch)] = best, out
            del kv
            lm.model.graphs = None  # frees the graphs captured over this batch's K/V
    rows = transfers(lm, args.restore_tokens) if args.restore_tokens else []
    print()
    print(f"{'decode tok/s':<34}" + "".join(f"{'batch ' + str(b):>12}" for b in batches))
    for name in names:
        print(f"{name:<34}" + "".join(f"{results[(name, b)]:12.1f}" for b in batches))
    print(f"{'roofline x batch (bf16)':<34}" + "".join(f"{roof * b:12.0f}" for b in batches))
    for fmt in formats:
        prefix = "" if fmt == "bf16" else f"{fmt}, "
        for b in batches:
            graph, eager = tokens[(prefix + "default, CUDA graphs", b)], tokens[(prefix + "default, --no-cuda-graphs", b)]
            n = sum(len(t) for t in graph)
            print(f"{fmt} batch {b}: graph tokens {'IDENTICAL to' if graph == eager else 'DIFFER from'} "
                  f"--no-cuda-graphs ({n} tokens)")
        print(f"{fmt}: prefill {probe.numel()} tokens {prefill[fmt]:.0f} tok/s")
    if "int4" in formats and "bf16" in formats:
        for b in batches:
            ratio = results[("int4, default, CUDA graphs", b)] / results[("default, CUDA graphs", b)]
            print(f"int4 / bf16, CUDA graphs, batch {b}: {ratio:.2f}x")
        err = (logits["int4"] - logits["bf16"]).norm(dim=-1) / logits["bf16"].norm(dim=-1)
        print(f"int4 logits vs bf16 over {probe.numel()} positions: relative difference median {err.median():.3f}, "
              f"max {err.max():.3f}")
    print(f"{'K/V transfer, ' + str(args.restore_tokens) + ' tokens':<34}{'GB/s':>12}")
    for name, rate in rows:
        print(f"{name:<34}{rate:12.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
