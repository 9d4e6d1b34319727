"""Write a random-weight Llama-family model as a Hugging Face folder, for benchmarks at real model sizes.

The folder has config.json, sharded safetensors, a byte-level tokenizer.json (one token per byte plus ChatML
specials) and a ChatML chat template, so `strata serve --model DIR` and transformers both load it.

    python tools/make_random_model.py OUT --shape llama3-8b [--dtype bfloat16] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from safetensors.torch import save_file

SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096, rope_theta=10000.0),
    "small": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                  num_key_value_heads=4, vocab_size=512, max_position_embeddings=16384, rope_theta=10000.0),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=32768,
                      rope_theta=500000.0),
    "llama3-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                       num_key_value_heads=8, vocab_size=128256, max_position_embeddings=32768,
                       rope_theta=500000.0),
}
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def write_tokenizer(out: str) -> None:
    """A byte-level tokenizer with no merges: every UTF-8 byte is one token; ids 256.. are the specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": None,
                   "tokenizer_class": "PreTrainedTokenizerFast"}, f)


def write_model(out: str, shape: dict, dtype: torch.dtype, device: str, shard_gib: float = 4.0) -> None:
    os.makedirs(out, exist_ok=True)
    h, inter, n_layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    n_heads, n_kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    hd = h // n_heads
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": str(dtype).removeprefix("torch."),
              "bos_token_id": 256, "eos_token_id": 258, **shape}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    write_tokenizer(out)

    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*dims: int, scale: float = 0.02) -> torch.Tensor:
        return (torch.randn(*dims, generator=gen, device=device, dtype=torch.float32) * scale).to(dtype).cpu()

    def tensors():
        yield "model.embed_tokens.weight", rand(shape["vocab_size"], h)
        for i in range(n_layers):
            p = f"model.layers.{i}."
            yield p + "input_layernorm.weight", torch.ones(h, dtype=dtype)
            yield p + "post_attention_layernorm.weight", torch.ones(h, dtype=dtype)
            yield p + "self_attn.q_proj.weight", rand(n_heads * hd, h)
            yield p + "self_attn.k_proj.weight", rand(n_kv * hd, h)
            yield p + "self_attn.v_proj.weight", rand(n_kv * hd, h)
            yield p + "self_attn.o_proj.weight", rand(h, n_heads * hd)
            yield p + "mlp.gate_proj.weight", rand(inter, h)
            yield p + "mlp.up_proj.weight", rand(inter, h)
            yield p + "mlp.down_proj.weight", rand(h, inter)
        yield "model.norm.weight", torch.ones(h, dtype=dtype)
        yield "lm_head.weight", rand(shape["vocab_size"], h)

    shard: dict[str, torch.Tensor] = {}
    size, index, n = 0, {}, 0
    limit = int(shard_gib * 2**30)

    def flush() -> None:
        nonlocal shard, size, n
        if not shard:
            return
        n += 1
        name = f"model-{n:05d}.safetensors"
        save_file(shard, os.path.join(out, name), metadata={"format": "pt"})
        index.update({k: name for k in shard})
        shard, size = {}, 0

    for name, t in tensors():
        shard[name] = t
        size += t.nbytes
        if size >= limit:
            flush()
    flush()
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": index}, f)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--device", default="cpu", help="where to draw the random numbers (cuda is much faster)")
    parser.add_argument("--layers", type=int, help="override the layer count")
    args = parser.parse_args(argv)
    shape = dict(SHAPES[args.shape])
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    write_model(args.out, shape, getattr(torch, args.dtype), args.device)
    print(f"wrote {args.shape} ({shape['num_hidden_layers']} layers, {args.dtype}) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
