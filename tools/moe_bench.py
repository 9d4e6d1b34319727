"""Prefill and decode throughput of a random-weight Qwen3-MoE model, engine variants against transformers in one
run. On the CPU: float experts, every layer's experts placed on the CPU as 4-bit groups with the rest float
(`--moe-experts cpu`), and all weights in int4 (`--cpu-weights int4`, the CPU default). On a GPU: experts on
the GPU (grouped GEMMs, decode in CUDA graphs, as `strata serve` runs by default), the same with
`--deterministic` (the per-expert loop, eager), the first half of the layers' experts on the CPU
(`--moe-cpu-layers`), and all of them there. Each variant's decode mode is set as the server sets it
(`graph_decode.configure`, one slot) and printed.

    python tools/moe_bench.py [--shape small|qwen3-30b-a3b] [--layers N] [--device cpu|cuda:0] [--rounds 3]
                              [--variants "experts gpu,experts gpu deterministic"]

The model is written once into --out (kept, so a second run skips it), with a byte-level tokenizer
(tools/make_random_model.py's); `small` is hidden 512, 8 layers of 32 experts of 256, top 4; `qwen3-30b-a3b`
is that model's shape (hidden 2048, 48 layers of 128 experts of 768, top 8; ~29 G expert weights: --layers
scales it down). Variants are loaded one at a time. Measured as tools/bench_throughput.py measures (best of
--rounds, each variant alternating with transformers so load from elsewhere hits both alike), with idle OpenMP
workers sleeping as in `strata serve` (OMP_WAIT_POLICY=PASSIVE unless the environment sets it).
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.cli import sleeping_cpu_workers  # noqa: E402

sleeping_cpu_workers()  # as `strata serve` runs (before torch loads): the machine is shared

import torch  # noqa: E402

from engine.model import int4, load_model, moe_placement, plan_stages, resolve_dtype  # noqa: E402
from engine.model.graph_decode import configure  # noqa: E402
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

SHAPES = {
    "small": dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                  moe_intermediate_size=256, num_hidden_layers=8, num_experts=32, num_experts_per_tok=4),
    "qwen3-30b-a3b": dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          moe_intermediate_size=768, num_hidden_layers=48, num_experts=128, num_experts_per_tok=8),
}


def write_model(out: str, shape: str, layers: int | None, dtype: torch.dtype, device: str = "cpu") -> str:
    """A random Qwen3-MoE folder of `shape` under `out` (reused when its config is already there); the random
    numbers are drawn on `device` (a GPU draws the 30B shape's in seconds)."""
    import transformers

    sizes = dict(SHAPES[shape], **({"num_hidden_layers": layers} if layers else {}))
    folder = os.path.join(out, f"qwen3moe-{shape}-{sizes['num_hidden_layers']}l")
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    config = transformers.Qwen3MoeConfig(
        vocab_size=512, intermediate_size=4 * sizes["moe_intermediate_size"], norm_topk_prob=True,
        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=256, eos_token_id=258, pad_token_id=0, **sizes,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    transformers.utils.logging.disable_progress_bar()
    model.save_pretrained(folder)
    del model
    write_tokenizer(folder)
    return folder


def variants(config, device: torch.device) -> dict[str, dict]:
    """Engine variants to measure on `device`: name -> load_model keyword arguments (and `deterministic`, the
    server's --deterministic)."""
    every = moe_placement.cpu_expert_layers(config, "cpu", 0)
    if device.type == "cpu":
        return {"float": {}, "experts cpu": {"cpu_experts": every}, "int4": {"int4_weights": True}}
    half = moe_placement.cpu_expert_layers(config, "gpu", config.n_layers // 2)
    return {"experts gpu": {}, "experts gpu deterministic": {"deterministic": True},
            f"cpu layers {config.n_layers // 2}": {"cpu_experts": half}, "experts cpu": {"cpu_experts": every}}


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
    parser.add_argument("--shape", choices=tuple(SHAPES), default="small")
    parser.add_argument("--layers", type=int, default=0, help="layers (0 = the shape's)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda:N")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", default="", help="comma-separated variant names to run (default: all)")
    args = parser.parse_args(argv)
    if not int4.available():
        print("this PyTorch has no CPU int4 kernels", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    dtype = resolve_dtype("auto", device)  # float32 on the CPU, bfloat16 on a GPU, as `strata serve` picks
    path = write_model(args.out, args.shape, args.layers or None, dtype, args.device)
    config = read_model_config(path)
    stages = plan_stages(config.n_layers, args.device, "")
    reference = hf_model(path, dtype, device)
    n_params = sum(p.numel() for p in reference.parameters())
    m = config.moe
    assert m is not None
    print(f"model {os.path.basename(path)}: {n_params / 1e9:.2f} G weights, hidden {config.hidden_size}, "
          f"{config.n_layers} layers of {m.n_experts} experts (top {m.top_k}, {m.expert_size} wide), {dtype}, {device}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}; {cpu_flags()}")
    ids, short = None, None
    rows: dict[str, dict[str, float]] = {}
    best = {"prefill": 0.0, "decode": 0.0}
    chosen = [v.strip() for v in args.variants.split(",") if v.strip()]
    for name, kwargs in variants(config, device).items():
        if chosen and name not in chosen:
            continue
        deterministic = kwargs.pop("deterministic", False)
        lm = load_model(path, stages, dtype, **kwargs)
        print(f"{name}: {configure(lm.model, 1, cuda_graphs=True, deterministic=deterministic)}", flush=True)
        if ids is None:
            ids, short = prompt_ids(lm.tokenizer, args.prompt_tokens), prompt_ids(lm.tokenizer, 32)
        arena = moe_placement.arena_bytes(lm.model.layers) / 2**20
        prefill, ref_prefill = compare(engine_prefill(lm, ids, args.prefill_chunk), hf_prefill(reference, ids),
                                       args.rounds)
        decode, ref_decode = compare(engine_decode(lm, short, args.decode_tokens),
                                     hf_decode(reference, short, args.decode_tokens), args.rounds)
        rows[name] = {"arena": arena, "prefill": prefill, "decode": decode}
        best = {"prefill": max(best["prefill"], ref_prefill or 0.0), "decode": max(best["decode"], ref_decode or 0.0)}
        del lm
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    rows["transformers (best beside all)"] = {"arena": float("nan"), **best}
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"load average at the end: {load:.1f} on {os.cpu_count()} CPUs ({time.strftime('%Y-%m-%d %H:%M')})")
    print(f"{'':<32}{'arena MiB':>10}{f'prefill {args.prompt_tokens} tok/s':>20}{f'decode {args.decode_tokens} tok/s':>20}")
    for name, row in rows.items():
        print(f"{name:<32}{row['arena']:10.1f}{row['prefill']:20.1f}{row['decode']:20.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
