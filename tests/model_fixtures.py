"""Tiny real models for tests: random weights in an HF folder (config.json, safetensors, tokenizer files).

`write_tiny_model(tmp_path, arch="llama")` writes a folder transformers and the engine both load. The
tokenizer is a real byte-level BPE trained on a few sentences; the chat template is ChatML with tools.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
# Tiny models with sliding-window attention, as each family declares it (window of 8 tokens): Mistral on every
# layer, Qwen2 from layer 1 on (use_sliding_window, max_window_layers), Gemma 3 on five layers of six (local
# layers with their own RoPE base).
SLIDING = {
    "mistral": {"sliding_window": 8},
    "qwen2": {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    "gemma3": {"sliding_window": 8},
}

CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions. Signatures:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\nReturn a call as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}{%- if not loop.first %}{{ raise_exception('system must come first') }}{%- endif %}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for call in message.tool_calls %}{%- set fn = call.function if call.function is defined else call %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + fn.name + '\", \"arguments\": ' }}"
    "{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! This is a tiny tokenizer for tests.",
    "def add(a, b):\n    return a + b\n",
    "The conversation cache parks attention state in RAM or on disk.",
    "Paris is the capital of France; Berlin is the capital of Germany.",
    "Numbers like 12345 and 3.14159 appear in text and code.",
    "Unicode: café, naïve, 東京, emoji 🙂🚀 and more.",
    "<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}</tool_call>",
]

TINY_SIZES = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}


@lru_cache(maxsize=1)
def tiny_tokenizer_json() -> str:
    """A byte-level BPE (vocab ~400) trained on a few sentences, with ChatML special tokens at ids 0-2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return tok.to_str()


def tiny_vocab_size() -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tiny_tokenizer_json()).get_vocab_size(with_added_tokens=True)


def write_tokenizer_files(folder: str | os.PathLike, chat_template: str = CHATML_TEMPLATE) -> None:
    """tokenizer.json + tokenizer_config.json (ChatML, eos <|im_end|>) into `folder`."""
    folder = Path(folder)
    (folder / "tokenizer.json").write_text(tiny_tokenizer_json(), encoding="utf-8")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "chat_template": chat_template,
        "model_max_length": TINY_SIZES["max_position_embeddings"],
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")


def tiny_hf_config(arch: str = "llama", **overrides):
    """A transformers config object for a tiny model of `arch`."""
    import transformers

    classes = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "gemma3": transformers.Gemma3TextConfig,
    }
    if arch not in classes:
        raise ValueError(f"arch: expected one of {', '.join(classes)}, got {arch!r}")
    kwargs = dict(TINY_SIZES)
    kwargs.update(
        vocab_size=tiny_vocab_size(),
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=arch in ("qwen2", "qwen3"),  # cover both tied and separate lm_head
        initializer_range=0.25,  # large enough that greedy choices are not near-ties
        bos_token_id=None,
        eos_token_id=2,
        pad_token_id=0,
    )
    if arch == "mistral":
        kwargs["sliding_window"] = None
    if arch == "gemma3":  # six layers: five local, one global; a query scale unlike 1/sqrt(head_dim)
        kwargs.update(num_hidden_layers=6, query_pre_attn_scalar=24, tie_word_embeddings=True, sliding_window=None,
                      bos_token_id=None, hidden_activation="gelu_pytorch_tanh")
        del kwargs["rope_theta"]  # rope_parameters per layer type: the defaults (1e6 global, 1e4 local)
    kwargs.update(overrides)
    return classes[arch](**kwargs)


def write_tiny_model(
    tmp_path: str | os.PathLike, arch: str = "llama", *, name: str | None = None, seed: int = 0, **overrides
) -> str:
    """Write a random-weight `arch` model (HF layout, safetensors) under tmp_path; returns the folder path."""
    import torch
    import transformers

    config = tiny_hf_config(arch, **overrides)
    folder = Path(tmp_path) / (name or f"tiny-{arch}")
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # Non-trivial norm weights, so a missing or misplaced norm shows in parity tests.
        for pname, param in model.named_parameters():
            if "norm" in pname:
                # Gemma's norms scale by (1 + w): the same effective range.
                param.uniform_(-0.5, 0.5) if arch == "gemma3" else param.uniform_(0.5, 1.5)
            elif pname.endswith(".bias"):
                param.normal_(0.0, 0.5)
    transformers.utils.logging.disable_progress_bar()
    model.save_pretrained(folder)
    write_tokenizer_files(folder)
    return str(folder)


_GGUF_LAYER_NAMES = {
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
}
_GGUF_GEMMA_NAMES = {
    **_GGUF_LAYER_NAMES, "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight", "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}


# Byte offsets of the float16 fields (scales, minimums) inside one block of each block format.
F16_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "IQ4_NL": (0,), "IQ4_XS": (0,), "MXFP4": (),  # MXFP4: an e8m0 exponent byte, no float16 field
}


def random_blocks(qtype, rows: int, cols: int, seed: int = 0, scale: float | None = None):
    """Random raw bytes (uint8 [rows, bytes per row]) of a [rows, cols] tensor of block format `qtype`: every
    bit random except the float16 scale fields, which are finite (of magnitude ~`scale` when given, else
    spread over normal and subnormal magnitudes of both signs, with some zeros)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES

    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    n_blocks = rows * cols // block
    raw = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    for at in F16_FIELDS.get(qtype.name, ()):  # a type this engine does not decode: random bytes throughout
        if scale is None:
            values = rng.standard_normal(n_blocks) * 10.0 ** rng.integers(-7, 2, n_blocks)
            values[::17] = 0
        else:
            values = rng.uniform(0.5, 1.5, n_blocks) * scale
        raw[:, at : at + 2] = values.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(rows, -1)


def add_tiny_tokenizer(writer) -> None:
    """The tiny tokenizer (tokens, merges, special ids, ChatML template) as GGUF metadata on `writer`."""
    spec = json.loads(tiny_tokenizer_json())
    vocab = {**spec["model"]["vocab"], **{t["content"]: t["id"] for t in spec["added_tokens"]}}
    tokens = [tok for tok, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)


def write_tiny_gguf(
    tmp_path: str | os.PathLike,
    arch: str = "llama",
    *,
    quantize: bool = True,
    seed: int = 0,
    qtype: str = "Q8_0",
    tensor_types: dict[str, str] | None = None,
    **overrides,
) -> str:
    """Convert a tiny HF model to a GGUF file the way llama.cpp's converter does (q/k rows permuted for
    llama, 2-D weights in `qtype` when `quantize`, or in `tensor_types[gguf name]`); returns the .gguf path.
    The HF folder sits beside it. Types gguf cannot quantise to (the K-quants) get random blocks, the
    weights then no longer those of the HF model. `overrides` change the HF config (sizes)."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    folder = write_tiny_model(tmp_path, arch, seed=seed, **overrides)
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    gguf_arch = "llama" if arch == "mistral" else arch
    n_heads, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    path = Path(tmp_path) / f"tiny-{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), gguf_arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(n_kv)
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    gemma = arch == "gemma3"
    rope = cfg["rope_parameters"]["full_attention"] if gemma else cfg["rope_parameters"]
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    if gemma:  # llama.cpp's gemma3 keys: the window; the period of 6 and the local base are implied
        writer.add_sliding_window(cfg["sliding_window"])

    add_tiny_tokenizer(writer)

    def permute(w: np.ndarray, heads: int) -> np.ndarray:
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    weights = load_file(os.path.join(folder, "model.safetensors"))
    for name, w in weights.items():
        if name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        elif name == "lm_head.weight":
            out = "output.weight"
        else:
            _, _, index, rest = name.split(".", 3)
            out = f"blk.{index}.{(_GGUF_GEMMA_NAMES if gemma else _GGUF_LAYER_NAMES)[rest]}"
        w = w.astype(np.float32)
        if gemma and "norm" in out:  # llama.cpp's converter stores Gemma's (1 + w)
            w = w + 1.0
        if gguf_arch == "llama" and out.endswith(("attn_q.weight", "attn_q.bias")):
            w = permute(w, n_heads)
        elif gguf_arch == "llama" and out.endswith(("attn_k.weight", "attn_k.bias")):
            w = permute(w, n_kv)
        kind = (tensor_types or {}).get(out, qtype if quantize and w.ndim == 2 else None)
        if kind is not None:
            kind = gguf.GGMLQuantizationType[kind]
            try:
                q = gguf.quants.quantize(w, kind)
            except NotImplementedError:
                q = random_blocks(kind, *w.shape, seed=len(out), scale=float(np.abs(w).mean()) / 200)
            writer.add_tensor(out, q, raw_shape=q.shape, raw_dtype=kind)
        else:
            writer.add_tensor(out, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def write_decode_models(root: Path) -> dict[str, str]:
    """The tiny models the decode-step tests run: each of ARCHS, Qwen2 with a sliding window of 8 from layer 1 on,
    and Gemma 3 (local layers with their own RoPE, GeGLU, output norms); name -> folder."""
    models = {arch: write_tiny_model(root, arch) for arch in ARCHS}
    models["qwen2-sliding"] = write_tiny_model(root / "sliding", "qwen2", use_sliding_window=True, sliding_window=8,
                                               max_window_layers=1)
    models["gemma3"] = write_tiny_model(root / "gemma", "gemma3")
    return models
