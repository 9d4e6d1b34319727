"""Prefill and decode throughput of the engine's model vs transformers on the same weights, in one run.

    python tools/bench_throughput.py [--model PATH] [--device cpu] [--dtype auto]

Each figure is the best of --rounds, engine and transformers measured alternately. Prefill: tokens per second for a prompt of N tokens (engine: forward_chunks in --prefill-chunk pieces over
KVBuffers; transformers: one forward with a KV cache). Decode: new tokens per second of greedy generation
after a short prompt (engine: one-token chunks; transformers: generate, minus its prefill).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.kv import KVBuffers, KVLayout  # noqa: E402
from engine.model import SeqChunk, embedded_model_path, load_model, plan_stages, resolve_dtype  # noqa: E402
from engine.model.loader import read_model_config  # noqa: E402

FILLER = (
    "The conversation cache keeps the attention state of a conversation that was switched out, so that when "
    "it comes back its history is not computed again. def step(self): return self.scheduler.schedule() "
)


def prompt_ids(tokenizer, n: int) -> torch.Tensor:
    ids = tokenizer.encode(FILLER)
    reps = n // len(ids) + 1
    return torch.tensor((ids * reps)[:n], dtype=torch.int64)


def timed(fn) -> float:
    """Seconds `fn` takes, including the GPU work it queued (CUDA calls return before the kernels finish)."""
    _sync()
    t = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def engine_prefill(lm, ids: torch.Tensor, chunk: int):
    """A callable that prefills `ids` in `chunk`-token pieces into a fresh slot; returns tok/s."""
    kv = make_kv(lm, len(ids) + 1)

    def run() -> float:
        return len(ids) / timed(
            lambda: [lm.model.forward_chunks([SeqChunk(0, a, ids[a : a + chunk])], kv) for a in range(0, len(ids), chunk)]
        )

    return run


def engine_decode(lm, prompt: torch.Tensor, n_new: int, step_threads=None):
    """A callable that greedily decodes `n_new` tokens after `prompt`; returns tok/s. With `step_threads` (an
    engine.runtime.threads.StepThreads) each step runs on the count it gives and is timed back into it, as the
    engine's loop does."""
    kv = make_kv(lm, len(prompt) + n_new + 1)
    first = int(lm.model.forward_chunks([SeqChunk(0, 0, prompt)], kv)[0].argmax())

    def run() -> float:
        token = first

        def loop() -> None:
            nonlocal token
            for pos in range(len(prompt), len(prompt) + n_new):
                if step_threads is not None:
                    step_threads.before_step(True)
                    started = time.perf_counter()
                logits = lm.model.forward_chunks([SeqChunk(0, pos, torch.tensor([token]))], kv)
                token = int(logits[0].argmax())
                if step_threads is not None:
                    step_threads.after_step(True, 1, time.perf_counter() - started)

        return n_new / timed(loop)

    return run


def make_kv(lm, ctx: int) -> KVBuffers:
    c = lm.config
    return KVBuffers(KVLayout(c.n_layers, c.n_kv_heads, c.head_dim, lm.dtype), 1, ctx, lm.model.stages)


def hf_model(path: str, dtype: torch.dtype, device: torch.device):
    import transformers

    transformers.utils.logging.disable_progress_bar()
    if os.path.isdir(path):
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype
        )
    return model.to(device).eval()


def hf_prefill(model, ids: torch.Tensor):
    x = ids[None].to(model.device)

    def run() -> float:
        with torch.inference_mode():
            return len(ids) / timed(lambda: model(x, use_cache=True))

    return run


def hf_decode(model, prompt: torch.Tensor, n_new: int):
    x = prompt[None].to(model.device)

    def generate(n: int) -> float:
        with torch.inference_mode():
            return timed(lambda: model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0))

    def run() -> float:
        return n_new / (generate(n_new + 1) - generate(1))  # minus the prefill and first token

    return run


def compare(ours, theirs, rounds: int) -> tuple[float, float | None]:
    """Best of `rounds` for each side, alternating so that load from elsewhere hits both alike."""
    ours()  # warm-up
    if theirs is not None:
        theirs()
    best_ours, best_theirs = 0.0, 0.0
    for _ in range(rounds):
        best_ours = max(best_ours, ours())
        if theirs is not None:
            best_theirs = max(best_theirs, theirs())
    return best_ours, (best_theirs if theirs is not None else None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="GGUF file or HF folder (default: the embedded SmolLM2)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda:N")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    parser.add_argument("--prompt-tokens", default="512,2048", help="prefill lengths to measure")
    parser.add_argument("--prefill-chunk", type=int, default=512, help="engine prefill chunk (tokens)")
    parser.add_argument("--decode-tokens", type=int, default=64, help="tokens generated per decode run")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    parser.add_argument("--rounds", type=int, default=3, help="measurements per side (best is kept)")
    parser.add_argument("--cpu-weights", choices=("float", "int4"), default="float",
                        help="int4: the engine's --cpu-weights int4 (transformers stays float32)")
    parser.add_argument("--no-transformers", action="store_true", help="measure the engine only")
    args = parser.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    path = args.model or embedded_model_path()
    t = time.perf_counter()
    lm = load_model(path, plan_stages(read_model_config(path).n_layers, args.device, ""), dtype)
    if args.cpu_weights == "int4":
        from engine.model.int4 import quantize_model

        before, after = quantize_model(lm.model)
        print(f"int4 weights: {before / 2**20:.0f} MiB of projections now {after / 2**20:.0f} MiB")
    load_s = time.perf_counter() - t
    lengths = [int(n) for n in args.prompt_tokens.split(",") if n]
    short = prompt_ids(lm.tokenizer, 32)

    print(f"model {lm.name} ({lm.config.n_layers} layers, hidden {lm.config.hidden_size}), {dtype}, {device}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    print(f"engine load {load_s:.1f} s")
    model = None if args.no_transformers else hf_model(path, dtype, device)
    rows = []
    for n in lengths:
        ids = prompt_ids(lm.tokenizer, n)
        theirs = hf_prefill(model, ids) if model is not None else None
        rows.append((f"prefill {n}", *compare(engine_prefill(lm, ids, args.prefill_chunk), theirs, args.rounds)))
    theirs = hf_decode(model, short, args.decode_tokens) if model is not None else None
    rows.append((f"decode {args.decode_tokens}", *compare(engine_decode(lm, short, args.decode_tokens), theirs, args.rounds)))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"load average at the end: {load:.1f} on {os.cpu_count()} CPUs")
    print(f"{'':<14}{'engine tok/s':>14}{'transformers':>14}{'ratio':>8}")
    for key, value, ref in rows:
        ratio = f"{value / ref:7.2f}x" if ref else ""
        ref_text = f"{ref:14.1f}" if ref else f"{'-':>14}"
        print(f"{key:<14}{value:14.1f}{ref_text}{ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
