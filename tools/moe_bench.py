"""Prefill and decode throughput of a random-weight Qwen3-MoE model on the CPU: the engine with float experts,
with every layer's experts placed on the CPU as 4-bit groups (`--moe-experts cpu`, the rest float), with all
weights in int4 (`--cpu-weights int4`, the CPU default), and transformers in float32, in one run.

    python tools/moe_bench.py [--out DIR] [--layers 8] [--experts 32] [--top-k 4] [--rounds 3]

The model is written once into --out (kept, so a second run skips it): hidden 512, experts of 256, a byte-level
tokenizer (tools/make_random_model.py's). Measured as tools/bench_throughput.py measures (best of --rounds,
the sides alternating so load from elsewhere hits all alike), with idle OpenMP workers sleeping as in
`strata serve` (OMP_WAIT_POLICY=PASSIVE unless the environment sets it).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.cli import sleeping_cpu_workers  # noqa: E402

sleeping_cpu_workers()  # as `strata serve` runs (before torch loads): the machine is shared

import torch  # noqa: E402

from engine.model import int4, load_model, moe_placement, plan_stages  # noqa: E402
from engine.model.loader import read_model_config  # noqa: E402
from tools.bench_throughput import (  # noqa: E402
    compare,
    engine_decode,
    engine_prefill,
    hf_decode,
    hf_model,
    hf_prefill,
    prompt_ids,
)
from tools.make_random_model import write_tokenizer  # noqa: E402


def write_model(out: str, layers: int, experts: int, top_k: int) -> str:
    """A random Qwen3-MoE folder under `out` (reused when its config is already there)."""
    import transformers

    folder = os.path.join(out, f"qwen3moe-{layers}l-{experts}e-top{top_k}")
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    config = transformers.Qwen3MoeConfig(
        vocab_size=512, hidden_size=512, num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2,
        head_dim=64, moe_intermediate_size=256, intermediate_size=1024, num_experts=experts,
        num_experts_per_tok=top_k, norm_topk_prob=True, max_position_embeddings=4096, rope_theta=10000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=256, eos_token_id=258, pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    transformers.utils.logging.disable_progress_bar()
    model.save_pretrained(folder)
    write_tokenizer(folder)
    return folder


def cpu_flags() -> str:
    """The CPU's vector extensions that matter here (lscpu's flags: avx, avx2, avx512*, amx*)."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("Flags")), [])
    kept = [f for f in flags if f in ("avx", "avx2") or f.startswith(("avx512", "amx"))]
    return f"{model}; {' '.join(kept)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="/tmp/strata-moe-bench", help="folder for the random model (kept)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if not int4.available():
        print("this PyTorch has no CPU int4 kernels", file=sys.stderr)
        return 2

    path = write_model(args.out, args.layers, args.experts, args.top_k)
    config = read_model_config(path)
    stages = plan_stages(config.n_layers, "cpu", "")
    every_layer = moe_placement.cpu_expert_layers(config, "cpu", 0)
    variants = {
        "float": load_model(path, stages, torch.float32),
        "experts cpu": load_model(path, stages, torch.float32, cpu_experts=every_layer),
        "int4": load_model(path, stages, torch.float32, int4_weights=True),
    }
    reference = hf_model(path, torch.float32, torch.device("cpu"))
    n_params = sum(p.numel() for p in reference.parameters())
    print(f"model {os.path.basename(path)}: {n_params / 1e6:.0f} M weights, hidden {config.hidden_size}, "
          f"{config.n_layers} layers of {args.experts} experts (top {args.top_k}, 256 wide)")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}; {cpu_flags()}")
    for name, lm in variants.items():
        print(f"  {name:<12} expert arena {moe_placement.arena_bytes(lm.model.layers) / 2**20:7.1f} MiB")

    ids = prompt_ids(variants["float"].tokenizer, args.prompt_tokens)
    short = prompt_ids(variants["float"].tokenizer, 32)
    rows: dict[str, dict[str, float]] = {}
    for name, lm in variants.items():
        # transformers is measured beside each variant (alternating), and its best over all of them kept.
        prefill, ref_prefill = compare(engine_prefill(lm, ids, args.prefill_chunk), hf_prefill(reference, ids),
                                       args.rounds)
        decode, ref_decode = compare(engine_decode(lm, short, args.decode_tokens),
                                     hf_decode(reference, short, args.decode_tokens), args.rounds)
        rows[name] = {"prefill": prefill, "decode": decode}
        best = rows.setdefault("transformers", {"prefill": 0.0, "decode": 0.0})
        best["prefill"] = max(best["prefill"], ref_prefill or 0.0)
        best["decode"] = max(best["decode"], ref_decode or 0.0)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"load average at the end: {load:.1f} on {os.cpu_count()} CPUs ({time.strftime('%Y-%m-%d %H:%M')})")
    print(f"{'':<14}{f'prefill {args.prompt_tokens} tok/s':>20}{f'decode {args.decode_tokens} tok/s':>20}")
    for name, row in rows.items():
        print(f"{name:<14}{row['prefill']:20.1f}{row['decode']:20.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
