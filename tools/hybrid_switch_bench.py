"""Switch-back time to first token of a hybrid model (recurrent layers + attention), conversation cache off and on.

Two conversations of N prompt tokens (random token ids: no tokenizer involved) take turns on one slot; each
return of conversation A adds a few tokens. With the cache off A is prefilled again from token 0; with it on,
A's K/V and recurrent state are restored from its checkpoint at its end. Also: an edited message (A's prompt
changed 100 tokens before its end) against a cold prefill, which resumes from the deepest checkpoint before the
edit, and the bytes of one checkpoint. With --restart (disk or tiered storage) also the first request after a
restart: A parked, its engine closed, a new engine on the same folder answering A's next turn, against a new
engine with the cache off answering the same prompt, each of those two in a process of its own (a restart's
first request is a new process's). The other engines run one after another in this process.

    python tools/hybrid_switch_bench.py --make qwen3_5 [--tokens 2048] [--storage ram]   # a random model
    python tools/hybrid_switch_bench.py --model DIR [--tokens 2048,4096]
    python tools/hybrid_switch_bench.py --make lfm2 --storage disk --restart   # also the first turn after a restart
    python tools/hybrid_switch_bench.py --make qwen3_5 --shape qwen3.5-9b --device cuda:0 --tokens 16384
    python tools/hybrid_switch_bench.py --model DIR --device cuda:0 --moe-experts cpu   # a MoE model, experts in RAM

`--shape qwen3.5-9b` (Qwen3.5 only) writes that model's shape (hidden 4096, 32 layers, 24 DeltaNet, vocab 248320)
in bfloat16, its random numbers drawn on --device.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.model.hybrid import fla_kernels  # noqa: E402
from engine.runtime.engine import Engine  # noqa: E402
from engine.runtime.memory import RecurrentMemory  # noqa: E402
from engine.runtime.requests import GenerationRequest, SamplingParams  # noqa: E402

VOCAB = 512
ARCHS = ("qwen3_5", "qwen3_next", "lfm2", "granitemoehybrid", "nemotron_h", "falcon_h1")


# Qwen3.5-9B's text model: the config keys that differ from the small shape below.
QWEN35_9B = dict(vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                 num_attention_heads=16, num_key_value_heads=4, head_dim=256, linear_key_head_dim=128,
                 linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
                 max_position_embeddings=262144)


def make_model(arch: str, out: str, shape: str = "small", device: str = "cpu") -> str:
    """A random-weight hybrid HF folder (`_config`'s shape) with a byte tokenizer; `shape` "qwen3.5-9b": that
    model's shape in bfloat16 (random numbers drawn on `device`)."""
    import transformers

    from tools.make_random_model import write_tokenizer

    if shape != "small" and arch != "qwen3_5":
        raise SystemExit(f"--shape {shape}: only for --make qwen3_5")
    config = _config(arch, shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            config, dtype=torch.float32 if shape == "small" else torch.bfloat16)
    model.save_pretrained(out)
    del model
    write_tokenizer(out)
    return out


def _config(arch: str, shape: str):
    """The transformers config of a random `arch` hybrid: 8 layers (Nemotron-H: 8 mixer blocks, each followed
    by its MLP block, as its layers come in separate blocks), hidden 512; 3 recurrent : 1 attention but for
    Falcon-H1, whose every layer runs attention and Mamba-2 side by side. Mamba-2 mixers (Granite-4.0-H,
    Nemotron-H, Falcon-H1) have one shape: 16 heads of 64, one group, state 64; gated DeltaNet ones (Qwen3.5,
    Qwen3-Next) 4 key and 8 value heads of 64."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=32768,
                  tie_word_embeddings=False)
    recurrent = {"lfm2": "conv"}.get(arch, "linear_attention")
    types = ([recurrent] * 3 + ["full_attention"]) * 2
    deltanet = dict(head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=4,
                    linear_num_value_heads=8, linear_conv_kernel_dim=4)
    if arch == "qwen3_5":
        if shape == "qwen3.5-9b":
            deltanet, types = {"linear_conv_kernel_dim": 4}, ([recurrent] * 3 + ["full_attention"]) * 8
            common.update(QWEN35_9B)
        return transformers.Qwen3_5TextConfig(**{**common, **deltanet}, layer_types=types)
    if arch == "qwen3_next":  # 8 experts of 384, 2 per token, and a shared one: about Qwen3.5's MLP per token
        return transformers.Qwen3NextConfig(**common, **deltanet, layer_types=types, num_experts=8,
                                            num_experts_per_tok=2, moe_intermediate_size=384,
                                            shared_expert_intermediate_size=768, decoder_sparse_step=1)
    if arch == "lfm2":
        return transformers.Lfm2Config(**common, layer_types=types, conv_L_cache=3)
    if arch == "granitemoehybrid":
        return transformers.GraniteMoeHybridConfig(
            **common, shared_intermediate_size=1536, num_local_experts=0, num_experts_per_tok=0, layer_types=types,
            position_embedding_type="nope", mamba_n_heads=16, mamba_n_groups=1, mamba_d_state=64, mamba_d_conv=4,
            mamba_expand=2, mamba_chunk_size=256)
    if arch == "nemotron_h":
        common.pop("num_hidden_layers")
        blocks = [b for t in types for b in (t, "mlp")]
        return transformers.NemotronHConfig(
            **common, head_dim=64, layers_block_type=blocks, ssm_state_size=64, mamba_num_heads=16,
            mamba_head_dim=64, n_groups=1, conv_kernel=4, chunk_size=256)
    if arch == "falcon_h1":
        return transformers.FalconH1Config(
            **common, head_dim=64, mamba_d_ssm=1024, mamba_n_heads=16, mamba_d_head=64, mamba_n_groups=1,
            mamba_d_state=64, mamba_d_conv=4, mamba_chunk_size=256)
    raise SystemExit(f"--make: expected one of {', '.join(ARCHS)}, got {arch!r}")


def ask(engine: Engine, prompt: list[int]) -> tuple[float, int, list[int]]:
    """(seconds to the first token, cached tokens, the greedy tokens)."""
    t0, first, cached, tokens = time.perf_counter(), 0.0, 0, []
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for event in engine.submit(GenerationRequest(f"bench-{time.time_ns()}", prompt, params)):
        assert event.error is None, event.error
        if event.token_id is not None:
            tokens.append(event.token_id)
            first = first or time.perf_counter() - t0
        if event.usage is not None:
            cached = event.usage.cached_tokens
    return first, cached, tokens


def prompts(n: int) -> list[list[int]]:
    """Conversations A and B: n random token ids each (the same ones in every run)."""
    return [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(s)).tolist() for s in (1, 2)]


def open_engine(model: str, n: int, storage: str, cache_mib: int, folder: str, device: str,
                moe_experts: str = "gpu", cpu_weights: str = "float") -> Engine:
    """An engine for two conversations of n tokens; cache_mib 0: the cache off."""
    return Engine.from_config(EngineConfig(
        model=model, devices=device, ctx_size=2 * n + 256, cpu_weights=cpu_weights, conversation_cache_mib=cache_mib,
        conversation_cache_storage=storage, conversation_cache_dir=folder, conversation_cache_min_free_mib=0,
        moe_experts=moe_experts))


def run(model: str, n: int, storage: str, cache_mib: int, folder: str, device: str = "cpu",
        moe_experts: str = "gpu", cpu_weights: str = "float") -> dict:
    engine = open_engine(model, n, storage, cache_mib, folder, device, moe_experts, cpu_weights)
    try:
        a, b = prompts(n)
        _, _, out = ask(engine, a)
        ask(engine, b)
        switch = []
        for r in range(3):
            a = a + out + [7, 8, 9]
            t, cached, out = ask(engine, a)
            switch.append(t)
            ask(engine, b + [5, r])  # B takes the slot again
        edited = a[: len(a) - 100] + [11, 12, 13]
        t_edit, cached_edit, _ = ask(engine, edited)
        memory = engine.memory
        state = memory.states.nbytes // engine.n_slots if isinstance(memory, RecurrentMemory) else 0
    finally:
        engine.close()
    return {"switch_s": statistics.median(switch), "cached": cached, "edit_s": t_edit, "edit_cached": cached_edit,
            "state_bytes": state}


def restart(model: str, n: int, storage: str, cache_mib: int, folder: str, device: str = "cpu",
            moe_experts: str = "gpu", cpu_weights: str = "float") -> dict:
    """First request after a restart vs cold: an engine answers A then B (A parked to `storage`) and is closed; a
    fresh engine on the same folder answers A's next turn, and a fresh engine with the cache off the same prompt,
    each in a new process as a restart is (an engine after others in one process finds its allocator grown)."""
    assert storage in ("disk", "tiered"), "a restart keeps only what is on disk"
    a, b = prompts(n)
    engine = open_engine(model, n, storage, cache_mib, folder, device, moe_experts, cpu_weights)
    try:
        _, _, out = ask(engine, a)
        ask(engine, b)
    finally:
        engine.close()
    a = a + out + [7, 8, 9]
    timed = {}
    spawn = multiprocessing.get_context("spawn")
    for side, mib in (("restart", cache_mib), ("cold", 0)):
        where = (model, n, storage if mib else "ram", mib, folder if mib else folder + "-off", device, moe_experts,
                 cpu_weights)
        with spawn.Pool(1) as fresh:
            timed[side] = fresh.apply(_first_request, (where, a, fla_kernels.ENABLED))
    assert timed["restart"][2] == timed["cold"][2], "the restored conversation answered otherwise than a cold one"
    return {"restart_s": timed["restart"][0], "cached": timed["restart"][1], "cold_s": timed["cold"][0]}


def _first_request(where: tuple, prompt: list[int], fla: bool) -> tuple[float, int, list[int]]:
    """A new engine (`open_engine(*where)`) answers `prompt` as its first request; `ask`'s figures."""
    fla_kernels.ENABLED = fla
    engine = open_engine(*where)
    try:
        return ask(engine, prompt)
    finally:
        engine.close()


def restart_line(n: int, storage: str, r: dict) -> str:
    return (f"{n} tokens: first request after a restart ({storage}) {r['restart_s']:.3f} s "
            f"({r['cached']} cached), cold {r['cold_s']:.3f} s ({r['cold_s'] / r['restart_s']:.1f}x)")


def switch_parser(doc: str) -> argparse.ArgumentParser:
    """The switch-back benchmarks' common flags: --model, --tokens (comma-separated), --storage."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="")
    parser.add_argument("--tokens", default="2048")
    parser.add_argument("--storage", choices=("ram", "disk", "tiered"), default="ram")
    return parser


def off_and_on(args: argparse.Namespace, tmp: str, run_one: Callable[..., dict]):
    """For each --tokens count: (tokens, the run with the cache off, the run with it on in --storage), after a
    line naming the threads, the load average and the storage."""
    print(f"threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}, storage {args.storage}")
    for n in (int(x) for x in args.tokens.split(",")):
        off = run_one(n, "ram", 0, os.path.join(tmp, "off"))  # the cache off (ram storage, no budget)
        on = run_one(n, args.storage, getattr(args, "cache_mib", 4096), os.path.join(tmp, "on"))
        yield n, off, on


def switch_line(n: int, off: dict, on: dict) -> str:
    return (f"{n} tokens: switch-back TTFT off {off['switch_s']:.3f} s, on {on['switch_s']:.3f} s "
            f"({off['switch_s'] / on['switch_s']:.1f}x, {on['cached']} cached)")


def main(argv: list[str] | None = None) -> int:
    parser = switch_parser(__doc__)
    parser.add_argument("--make", default="", help="write a random hybrid of this architecture and use it")
    parser.add_argument("--shape", choices=("small", "qwen3.5-9b"), default="small", help="with --make")
    parser.add_argument("--device", default="cpu", help="cpu or cuda:N")
    parser.add_argument("--no-fla", action="store_true", help="CUDA: the PyTorch delta rule even with fla-core")
    parser.add_argument("--cache-mib", type=int, default=4096, help="the cache's budget when on")
    parser.add_argument("--restart", action="store_true",
                        help="also time the first request after a restart (--storage disk or tiered) vs cold")
    parser.add_argument("--moe-experts", choices=("gpu", "cpu"), default="gpu",
                        help="a mixture-of-experts model: where its routed experts live (strata serve's flag)")
    parser.add_argument("--cpu-weights", choices=("float", "int4", "auto"), default="float",
                        help="strata serve's flag (float: the figures recorded so far; auto: the CPU default, int4)")
    args = parser.parse_args(argv)
    if args.restart and args.storage == "ram":
        parser.error("--restart: a restart keeps only what is on disk; give --storage disk or tiered")
    fla_kernels.ENABLED = not args.no_fla
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(args.make, os.path.join(tmp, "model"), args.shape, args.device) if args.make else args.model
        print(f"device {args.device}, fla-core {fla_kernels.usable(torch.device(args.device))}")
        for n, off, on in off_and_on(args, tmp, lambda *a: run(model, *a, device=args.device,
                                                                    moe_experts=args.moe_experts,
                                                                    cpu_weights=args.cpu_weights)):
            print(f"{switch_line(n, off, on)}; edited message off {off['edit_s']:.3f} s, on {on['edit_s']:.3f} s "
                  f"({on['edit_cached']} cached); "
                  f"one checkpoint {on['state_bytes'] / 2**20:.2f} MiB; load average {os.getloadavg()[0]:.1f}",
                  flush=True)
            if args.restart:
                r = restart(model, n, args.storage, args.cache_mib, os.path.join(tmp, f"restart-{n}"), args.device,
                            args.moe_experts, args.cpu_weights)
                print(f"{restart_line(n, args.storage, r)}; load average {os.getloadavg()[0]:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
