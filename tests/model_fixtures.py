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
        "gemma4": transformers.Gemma4TextConfig,
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
    if arch == "gemma4":  # six layers (five local); per-layer inputs, values = keys on the global layer, soft cap
        # The global layer wider than the sliding ones (4 K/V heads of 32 against 2 of 16), as the released models.
        kwargs.update(num_hidden_layers=6, tie_word_embeddings=True, sliding_window=8, global_head_dim=32,
                      num_global_key_value_heads=4, hidden_size_per_layer_input=8,
                      vocab_size_per_layer_input=kwargs["vocab_size"], attention_k_eq_v=True,
                      final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh",
                      initializer_range=0.2)  # at 0.25 float32's rounding grows to ~1.4e-4 through the six layers
        del kwargs["rope_theta"]  # the defaults: proportional RoPE (a quarter) at 1e6 global, 1e4 local
    kwargs.update(overrides)
    return classes[arch](**kwargs)


def on_int4_grid(w):
    """`w` rounded to min + scale * q (q in 0..15) per group of 32 along its last dimension."""
    groups = w.reshape(*w.shape[:-1], -1, 32)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale = ((high - low) / 15).clamp_min(1e-30)  # a constant group (the zero padding row) stays as it is
    return (low + scale * ((groups - low) / scale).round()).reshape(w.shape)


def write_tiny_model(
    tmp_path: str | os.PathLike, arch: str = "llama", *, name: str | None = None, seed: int = 0,
    int4_grid_experts: bool = False, **overrides
) -> str:
    """Write a random-weight `arch` model (HF layout, safetensors) under tmp_path; returns the folder path. With
    `int4_grid_experts` the expert stacks (Gemma 4's) lie on a 4-bit grid, so experts packed as 4-bit groups lose
    nothing but the kernel's bfloat16 activations."""
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
            elif pname.endswith(("router.scale", "per_expert_scale")):  # Gemma 4's router scales: not all 1
                param.uniform_(0.5, 1.5)
            elif int4_grid_experts and pname.endswith(("experts.gate_up_proj", "experts.down_proj")):
                param.copy_(on_int4_grid(param))
        for bname, buf in model.named_buffers():
            if bname.endswith("layer_scalar"):  # Gemma 4's per-layer output scalar: not 1, so it shows
                buf.uniform_(0.5, 1.5)
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

# llama.cpp's gemma4 names (conversion/gemma.py): Gemma 3's, with the per-layer inputs and the layer scalar.
_GGUF_GEMMA4_NAMES = {
    **_GGUF_GEMMA_NAMES, "per_layer_input_gate.weight": "inp_gate.weight", "per_layer_projection.weight": "proj.weight",
    "post_per_layer_input_norm.weight": "post_norm.weight", "layer_scalar": "layer_output_scale.weight",
    "router.proj.weight": "ffn_gate_inp.weight", "router.scale": "ffn_gate_inp.scale",
    "router.per_expert_scale": "ffn_down_exps.scale", "experts.gate_up_proj": "ffn_gate_up_exps.weight",
    "experts.down_proj": "ffn_down_exps.weight", "pre_feedforward_layernorm_2.weight": "pre_ffw_norm_2.weight",
    "post_feedforward_layernorm_1.weight": "post_ffw_norm_1.weight",
    "post_feedforward_layernorm_2.weight": "post_ffw_norm_2.weight",
}
_GGUF_GEMMA4_GLOBAL = {
    "model.embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
    "model.per_layer_model_projection.weight": "per_layer_model_proj.weight",
    "model.per_layer_projection_norm.weight": "per_layer_proj_norm.weight",
}


def _gemma4_gguf_keys(writer, cfg: dict) -> None:
    """The gemma4 metadata llama.cpp's converter writes beyond the common keys: the global layers' head width as
    key_length, the sliding ones' as key_length_swa, K/V heads per layer."""
    import numpy as np

    types = cfg["layer_types"]
    full = next(i for i, t in enumerate(types) if t == "full_attention")
    override = (cfg.get("per_layer_config") or {}).get(str(full), {})
    full_dim = cfg.get("global_head_dim") or override.get("head_dim") or cfg["head_dim"]
    full_kv = cfg.get("num_global_key_value_heads") or override.get("num_key_value_heads")
    writer.add_sliding_window(cfg["sliding_window"])
    writer.add_sliding_window_pattern([t == "sliding_attention" for t in types])
    shared = cfg.get("num_kv_shared_layers", 0)
    writer.add_shared_kv_layers(shared)
    if cfg.get("use_double_wide_mlp") and shared:  # the K/V-sharing layers' MLP twice as wide, per layer
        n_ff, n = cfg["intermediate_size"], len(types)
        writer.add_feed_forward_length([n_ff if i < n - shared else 2 * n_ff for i in range(n)])
    writer.add_embedding_length_per_layer_input(cfg.get("hidden_size_per_layer_input") or 0)
    writer.add_key_length(full_dim)
    writer.add_value_length(full_dim)
    writer.add_key_length_swa(cfg["head_dim"])
    writer.add_value_length_swa(cfg["head_dim"])
    if full_kv:
        writer.add_head_count_kv([cfg["num_key_value_heads"] if t == "sliding_attention" else full_kv for t in types])
    writer.add_rope_dimension_count(full_dim)
    writer.add_rope_dimension_count_swa(cfg["head_dim"])
    writer.add_rope_freq_base_swa(cfg["rope_parameters"]["sliding_attention"]["rope_theta"])
    if cfg.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if cfg.get("enable_moe_block"):
        writer.add_expert_count(cfg["num_experts"])
        writer.add_expert_used_count(cfg["top_k_experts"])
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    # Proportional RoPE on the global layers as divisors: 1 for the rotated frequencies, 1e30 for the others.
    pairs = int(full_dim * cfg["rope_parameters"]["full_attention"]["partial_rotary_factor"] / 2)
    writer.add_tensor("rope_freqs.weight", np.array([1.0] * pairs + [1e30] * (full_dim // 2 - pairs), dtype=np.float32))


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
    gemma4 = arch == "gemma4"
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
    rope = cfg["rope_parameters"]["full_attention"] if gemma or gemma4 else cfg["rope_parameters"]
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if not gemma4:  # llama.cpp's gemma4 files have none: the token list says it
        writer.add_vocab_size(cfg["vocab_size"])
    if gemma:  # llama.cpp's gemma3 keys: the window; the period of 6 and the local base are implied
        writer.add_sliding_window(cfg["sliding_window"])
    if gemma4:
        _gemma4_gguf_keys(writer, cfg)

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
        elif name in _GGUF_GEMMA4_GLOBAL:
            out = _GGUF_GEMMA4_GLOBAL[name]
        else:
            _, _, index, rest = name.split(".", 3)
            names = _GGUF_GEMMA4_NAMES if gemma4 else _GGUF_GEMMA_NAMES if gemma else _GGUF_LAYER_NAMES
            out = f"blk.{index}.{names[rest]}"
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
