"""Tool calling end to end: tools rendered by the model's template, Hermes `<tool_call>` output parsed back into
OpenAI `tool_calls`, and the follow-up turn (assistant tool_calls + a tool message) accepted.

The model is tiny and built so that greedy decoding always answers with one `<tool_call>` block: its vocabulary
gains the whole block as one token, every layer's output projection is zero (the last hidden state is the last
token's embedding), and the LM head maps "any prompt token" to the block and the block to <|im_end|>.
"""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Tokenizer

from tests.engine_process import engine_process
from tests.model_fixtures import write_tiny_model

TOOL_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
IM_END = 2
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def write_tool_calling_model(root: Path, call: str = TOOL_CALL) -> str:
    """A tiny Llama folder whose greedy answer to any chat is exactly `call` (TOOL_CALL unless given)."""
    return write_scripted_model(root, [call])


def write_scripted_model(root: Path, pieces: list[str], tokens: tuple[str, ...] = (), chat_template: str | None = None
                         ) -> str:
    """A tiny Llama folder whose greedy answer to any chat is `pieces`, one token each, in order (so each streams as
    its own chunk), then <|im_end|>; `tokens`: more vocabulary (markers a template uses), `chat_template` instead of
    ChatML."""
    folder = Path(write_tiny_model(root, "llama", name="tiny-tool-caller", num_hidden_layers=1))
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    added = list(tokens) + pieces
    assert tok.add_tokens([AddedToken(t, normalized=False) for t in added]) == len(added) == len(set(added))
    piece_ids = [tok.token_to_id(p) for p in pieces]
    tok.save(str(folder / "tokenizer.json"))
    vocab = tok.get_vocab_size()

    config = json.loads((folder / "config.json").read_text())
    config["vocab_size"] = vocab
    (folder / "config.json").write_text(json.dumps(config))
    if chat_template is not None:
        tok_config = json.loads((folder / "tokenizer_config.json").read_text())
        tok_config["chat_template"] = chat_template
        (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))

    [weights_file] = folder.glob("*.safetensors")
    weights = load_file(weights_file)
    hidden = config["hidden_size"]
    assert len(pieces) < hidden
    embed = torch.zeros(vocab, hidden)
    embed[:, 0] = 1.0  # every ordinary token looks the same to the head...
    head = torch.zeros(vocab, hidden)
    for n, piece_id in enumerate(piece_ids):  # ...and piece n differs, and leads to piece n + 1
        embed[piece_id] = torch.nn.functional.one_hot(torch.tensor(n + 1), hidden).float()
        head[piece_id, n] = 10.0
    head[IM_END, len(pieces)] = 10.0
    for name in list(weights):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(weights[name])
        elif "norm" in name:
            weights[name] = torch.ones_like(weights[name])
    weights["model.embed_tokens.weight"] = embed
    weights["lm_head.weight"] = head
    save_file(weights, weights_file, metadata={"format": "pt"})
    return str(folder)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    model = write_tool_calling_model(tmp_path_factory.mktemp("tool-model"))
    with engine_process("--model", model, "--ctx-size", "512", "--conversation-cache-mib", "0") as engine:
        yield openai.OpenAI(base_url=engine.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_tool_call_in_the_output_becomes_tool_calls(client):
    r = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, temperature=0, max_tokens=8)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_streamed_tool_call_arrives_as_one_tool_calls_delta(client):
    chunks = list(client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, temperature=0,
                                                 max_tokens=8, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(deltas) == 1
    assert deltas[0].index == 0 and deltas[0].function.name == "get_weather"
    assert json.loads(deltas[0].function.arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_without_tools_the_same_text_is_plain_content(client):
    for extra in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        r = client.chat.completions.create(model="m", messages=ASK, temperature=0, max_tokens=8, **extra)
        assert r.choices[0].message.content == TOOL_CALL
        assert not r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "stop"


def test_tools_are_rendered_into_the_prompt(client):
    plain = client.chat.completions.create(model="m", messages=ASK, temperature=0, max_tokens=1)
    with_tools = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, temperature=0, max_tokens=1)
    # The template lists every tool's JSON schema in a system block.
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 30


def test_follow_up_turn_with_the_tool_result_is_accepted(client):
    first = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, temperature=0, max_tokens=8)
    call = first.choices[0].message.tool_calls[0]
    messages = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21}'}]
    second = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, temperature=0, max_tokens=8)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 10
    assert second.choices[0].finish_reason == "tool_calls"
