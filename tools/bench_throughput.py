"""Prefill and decode throughput of the engine's model vs transformers on the same weights, in one run.

    python tools/bench_throughput.py [--model PATH] [--device cpu] [--dtype auto]

Prefill: tokens per second for a prompt of N tokens (engine: forward_chunks in --prefill-chunk pieces over
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

from engine.model import SeqChunk, embedded_model_path, load_model, plan_stages, resolve_dtype  # noqa: E402
from engine.model.loader import read_model_config  # noqa: E402
from engine.runtime.kv_buffers import KVBuffers, KVLayout  # noqa: E402

FILLER = (
    "The conversation cache keeps the attention state of a conversation that was switched out, so that when "
    "it comes back its history is not computed again. def step(self): return self.scheduler.schedule() "
)


def prompt_ids(tokenizer, n: int) -> torch.Tensor:
    ids = tokenizer.encode(FILLER)
    reps = n // len(ids) + 1
    return torch.tensor((ids * reps)[:n], dtype=torch.int64)


def best_of(reps: int, fn) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def engine_prefill(lm, ids: torch.Tensor, chunk: int) -> float:
    kv = make_kv(lm, len(ids) + 1)

    def run() -> None:
        for a in range(0, len(ids), chunk):
            lm.model.forward_chunks([SeqChunk(0, a, ids[a : a + chunk])], kv)

    run()  # warm-up
    return len(ids) / best_of(2, run)


def engine_decode(lm, prompt: torch.Tensor, n_new: int) -> float:
    kv = make_kv(lm, len(prompt) + n_new + 1)
    logits = lm.model.forward_chunks([SeqChunk(0, 0, prompt)], kv)
    token = int(logits[0].argmax())

    def run() -> None:
        nonlocal token
        for pos in range(len(prompt), len(prompt) + n_new):
            logits = lm.model.forward_chunks([SeqChunk(0, pos, torch.tensor([token]))], kv)
            token = int(logits[0].argmax())

    run()  # warm-up (overwrites the same rows)
    return n_new / best_of(2, run)


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


def hf_prefill(model, ids: torch.Tensor) -> float:
    x = ids[None].to(model.device)

    def run() -> None:
        with torch.inference_mode():
            model(x, use_cache=True)

    run()
    return len(ids) / best_of(2, run)


def hf_decode(model, prompt: torch.Tensor, n_new: int) -> float:
    x = prompt[None].to(model.device)
    kwargs = dict(do_sample=False, pad_token_id=0)

    def generate(n: int) -> None:
        with torch.inference_mode():
            model.generate(x, max_new_tokens=n, min_new_tokens=n, **kwargs)

    generate(4)  # warm-up
    first = best_of(2, lambda: generate(1))
    total = best_of(2, lambda: generate(n_new + 1))
    return n_new / (total - first)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="GGUF file or HF folder (default: the embedded SmolLM2)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda:N")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    parser.add_argument("--prompt-tokens", default="512,2048", help="prefill lengths to measure")
    parser.add_argument("--prefill-chunk", type=int, default=512, help="engine prefill chunk (tokens)")
    parser.add_argument("--decode-tokens", type=int, default=64, help="tokens generated per decode run")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    parser.add_argument("--no-transformers", action="store_true", help="measure the engine only")
    args = parser.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    path = args.model or embedded_model_path()
    t = time.perf_counter()
    lm = load_model(path, plan_stages(read_model_config(path).n_layers, args.device, ""), dtype)
    load_s = time.perf_counter() - t
    lengths = [int(n) for n in args.prompt_tokens.split(",") if n]
    short = prompt_ids(lm.tokenizer, 32)

    print(f"model {lm.name} ({lm.config.n_layers} layers, hidden {lm.config.hidden_size}), {dtype}, {device}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    print(f"engine load {load_s:.1f} s")
    ours = {f"prefill {n}": engine_prefill(lm, prompt_ids(lm.tokenizer, n), args.prefill_chunk) for n in lengths}
    ours[f"decode {args.decode_tokens}"] = engine_decode(lm, short, args.decode_tokens)
    theirs: dict[str, float] = {}
    if not args.no_transformers:
        model = hf_model(path, dtype, device)
        theirs = {f"prefill {n}": hf_prefill(model, prompt_ids(lm.tokenizer, n)) for n in lengths}
        theirs[f"decode {args.decode_tokens}"] = hf_decode(model, short, args.decode_tokens)
    print(f"{'':<14}{'engine tok/s':>14}{'transformers':>14}{'ratio':>8}")
    for key, value in ours.items():
        ref = theirs.get(key)
        ratio = f"{value / ref:7.2f}x" if ref else ""
        ref_text = f"{ref:14.1f}" if ref else f"{'-':>14}"
        print(f"{key:<14}{value:14.1f}{ref_text}{ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
