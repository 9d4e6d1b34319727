"""A tiny random-weight Llama whose tokenizer carries gpt-oss's harmony tokens, and whose greedy answer to any chat is
a fixed harmony output: reasoning on `analysis`, then a call to get_weather on `commentary`, ended by `<|call|>`.

The answer is a chain of added tokens, each holding a piece of harmony text (markers included, as the decoder writes
gpt-oss's own marker tokens): every layer's output projection is zero, so the last hidden state is the last token's
embedding; each script token has an embedding dimension of its own and the LM head maps it to the next one (every
other token, the prompt's last included, to the first).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Tokenizer

from engine.model.tokenizer import HARMONY_TOKENS
from tests.model_fixtures import tiny_tokenizer_json, write_tiny_model

REASONING = "The user asks for the weather in Paris."
ARGUMENTS = '{"city": "Paris"}'
SCRIPT = (
    "<|channel|>analysis<|message|>The user asks",
    " for the weather in Paris.",
    "<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>",
    ARGUMENTS,
)
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city"}},
                   "required": ["city"]}}}]


def harmony_tokenizer() -> Tokenizer:
    """The tiny test vocabulary with harmony's special tokens added."""
    tok = Tokenizer.from_str(tiny_tokenizer_json())
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in HARMONY_TOKENS])
    return tok


def write_harmony_model(root: Path, script_text: tuple[str, ...] = SCRIPT, end: str = "<|call|>") -> str:
    """The model folder (see the module docstring); `script_text` (one token each) and its `end` (`<|call|>` or
    `<|return|>`) for another answer."""
    folder = Path(write_tiny_model(root, "llama", name="tiny-harmony", num_hidden_layers=1))
    tok = harmony_tokenizer()
    assert tok.add_tokens([AddedToken(t, normalized=False) for t in script_text]) == len(script_text)
    tok.save(str(folder / "tokenizer.json"))
    script = [tok.token_to_id(t) for t in script_text]
    call = tok.token_to_id(end)
    vocab = tok.get_vocab_size()

    config = json.loads((folder / "config.json").read_text())
    config["vocab_size"] = vocab
    (folder / "config.json").write_text(json.dumps(config))
    tcfg = json.loads((folder / "tokenizer_config.json").read_text())
    tcfg["eos_token"] = "<|return|>"
    (folder / "tokenizer_config.json").write_text(json.dumps(tcfg))

    [weights_file] = folder.glob("*.safetensors")
    weights = load_file(weights_file)
    hidden = config["hidden_size"]
    embed = torch.zeros(vocab, hidden)
    embed[:, 0] = 1.0
    head = torch.zeros(vocab, hidden)
    head[script[0], 0] = 10.0
    for k, token in enumerate(script):
        embed[token] = torch.nn.functional.one_hot(torch.tensor(k + 1), hidden).float()
        head[script[k + 1] if k + 1 < len(script) else call, k + 1] = 10.0
    for name in list(weights):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(weights[name])
        elif "norm" in name:
            weights[name] = torch.ones_like(weights[name])
    weights["model.embed_tokens.weight"] = embed
    weights["lm_head.weight"] = head
    save_file(weights, weights_file, metadata={"format": "pt"})
    return str(folder)
