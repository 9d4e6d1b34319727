"""Bytes a parked token holds for a multi-head latent attention model, as `/cache/conversations` lists them,
beside what the same model's expanded per-head K/V would hold.

For each shape (DeepSeek-V3's and GLM-4.7-Flash's attention widths, on a random model of a few layers with a
small hidden size and few experts: a token's bytes per layer depend only on the attention shape) one engine in
this process parks a conversation of N tokens (B takes the one slot) and the conversation list gives its bytes.
Per token: measured (listed bytes / tokens, less the 4 bytes of its token id), computed (layers x (kv_lora_rank +
qk_rope_head_dim) x K/V dtype bytes), and expanded (layers x heads x (qk_nope + qk_rope + v_head_dim) x dtype
bytes: K and V of every head, what a K/V cache without MLA keeps); then both per token at the real depth.

    python tools/mla_cache_bytes.py [--tokens 512] [--kv-dtype bfloat16] [--layers 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.config import EngineConfig  # noqa: E402
from engine.runtime.engine import Engine  # noqa: E402
from tests.mla_fixtures import write_tiny_mla_model  # noqa: E402
from tools.hybrid_switch_bench import ask  # noqa: E402

# The released models' attention widths and depths (their config.json files).
SHAPES = {
    "DeepSeek-V3": ("deepseek_v3", 61, dict(num_attention_heads=128, kv_lora_rank=512, q_lora_rank=1536,
                                            qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)),
    "GLM-4.7-Flash": ("glm4_moe_lite", 47, dict(num_attention_heads=20, kv_lora_rank=512, q_lora_rank=768,
                                                qk_rope_head_dim=64, qk_nope_head_dim=192, v_head_dim=256)),
}


def measure(name: str, n: int, kv_dtype: str, layers: int, root: str) -> str:
    arch, depth, attention = SHAPES[name]
    kinds = ["dense"] + ["sparse"] * (layers - 1)
    extra = {"mlp_layer_types": kinds} if arch == "glm4_moe_lite" else {"first_k_dense_replace": 1, "n_group": 1,
                                                                        "topk_group": 1}
    folder = write_tiny_mla_model(os.path.join(root, arch), arch, num_hidden_layers=layers, hidden_size=256,
                                  max_position_embeddings=4 * n, **attention, **extra)
    engine = Engine.from_config(EngineConfig(
        model=folder, devices="cpu", ctx_size=2 * n + 64, kv_dtype=kv_dtype, conversation_cache_storage="ram",
        conversation_cache_min_free_mib=0))
    try:
        vocab = engine.tokenizer.vocab_size
        a, b = (torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(s)).tolist() for s in (1, 2))
        ask(engine, a)
        ask(engine, b)  # takes the slot: A is parked
        rows = engine.call(engine.cache_conversations).result()
        row = next(r for r in rows if r["tokens"] >= n and r["tokens"] < n + 8 and r["bytes"])
        tokens, listed = row["tokens"], row["bytes"]
        item = engine.layout.dtype.itemsize
        latent = attention["kv_lora_rank"] + attention["qk_rope_head_dim"]
        heads = attention["num_attention_heads"]
        per_head = attention["qk_nope_head_dim"] + attention["qk_rope_head_dim"] + attention["v_head_dim"]
        measured = (listed - 4 * tokens) / tokens
        computed, expanded = layers * latent * item, layers * heads * per_head * item
        assert measured == computed, (measured, computed)
        return (f"| {name} | {tokens} | {listed:,} | {measured:,.0f} | {computed:,} | {expanded:,} | "
                f"{expanded / computed:.1f}x | {depth * latent * item:,} | {depth * heads * per_head * item:,} |")
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--kv-dtype", default="bfloat16")
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args(argv)
    print(f"{args.layers} layers, K/V dtype {args.kv_dtype}, {args.tokens}-token conversations")
    print("| model shape | parked tokens | listed bytes | measured B/token | latent B/token | expanded K/V B/token "
          "| ratio | latent B/token, all layers | expanded B/token, all layers |")
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as root:
        for name in SHAPES:
            print(measure(name, args.tokens, args.kv_dtype, args.layers, root))
    return 0


if __name__ == "__main__":
    sys.exit(main())
