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
    }
    if arch not in classes:
        raise ValueError(f"arch: expected one of {', '.join(ARCHS)}, got {arch!r}")
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
                param.uniform_(0.5, 1.5)
            elif pname.endswith(".bias"):
                param.normal_(0.0, 0.5)
    transformers.utils.logging.disable_progress_bar()
    model.save_pretrained(folder)
    write_tokenizer_files(folder)
    return str(folder)
