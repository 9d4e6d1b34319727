"""The engine's forward pass and tokenizer against transformers on the same weights (float32, CPU)."""

from __future__ import annotations

import os

import pytest
import torch

from engine.kv import KVBuffers, KVLayout
from engine.model import SeqChunk, embedded_model_path, load_model, plan_stages
from tests.model_fixtures import ARCHS, write_tiny_gguf, write_tiny_model

transformers = pytest.importorskip("transformers")
transformers.utils.logging.disable_progress_bar()

# float32 on both sides; the only differences are summation orders (fused q/k/v, SDPA vs eager kernels).
TINY_ATOL = 1e-4
EMBEDDED_ATOL = 2e-3  # 30 layers, logits of magnitude ~30

TEXT = "The quick brown fox jumps over the lazy dog. def add(a, b): return a + b  café 🙂"


def _kv(lm, n_slots: int = 3, ctx: int = 256) -> KVBuffers:
    c = lm.config
    layout = KVLayout(c.n_layers, c.n_kv_heads, c.head_dim, lm.dtype)
    return KVBuffers(layout, n_slots, ctx, lm.model.stages)


def _load(path: str, devices: str = "cpu", split: str = ""):
    return load_model(path, plan_stages(_n_layers(path), devices, split), torch.float32)


def _n_layers(path: str) -> int:
    from engine.model.loader import read_model_config

    return read_model_config(path).n_layers


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: write_tiny_model(root, arch) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(tiny_models, arch):
    path = tiny_models[arch]
    lm = _load(path)
    ids = torch.tensor(lm.tokenizer.encode(TEXT))
    assert len(ids) > 20
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = ref_model(ids[None]).logits[0]
    ours = lm.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(lm), all_logits=True)[0]
    diff = _max_diff(ours, ref)
    assert diff <= TINY_ATOL, f"{arch}: max abs logit diff {diff:.3g} > {TINY_ATOL} (logit scale {ref.abs().max():.3g})"
    last = lm.model.forward_chunks([SeqChunk(1, 0, ids)], _kv(lm))
    diff_last = _max_diff(last[0], ref[-1])
    assert diff_last <= TINY_ATOL, f"{arch}: last-position logits differ by {diff_last:.3g}"


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_and_decode_equal_one_shot(tiny_models, arch):
    lm = _load(tiny_models[arch])
    ids = torch.tensor(lm.tokenizer.encode(TEXT))
    one_shot = lm.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(lm), all_logits=True)[0]
    kv = _kv(lm)
    n = len(ids)
    cuts = [0, 5, 12, n - 3]  # three prefill chunks (the later ones need the offset causal mask) ...
    for a, b in zip(cuts, cuts[1:], strict=False):
        got = lm.model.forward_chunks([SeqChunk(2, a, ids[a:b])], kv, all_logits=True)[0]
        diff = _max_diff(got, one_shot[a:b])
        assert diff <= TINY_ATOL, f"{arch}: prefill chunk [{a},{b}) differs from one-shot by {diff:.3g}"
    for pos in range(n - 3, n):  # ... then decode steps of one token
        got = lm.model.forward_chunks([SeqChunk(2, pos, ids[pos : pos + 1])], kv)[0]
        diff = _max_diff(got, one_shot[pos])
        assert diff <= TINY_ATOL, f"{arch}: decode at position {pos} differs from one-shot by {diff:.3g}"


def test_layer_split_over_two_stages_equals_one_stage(tiny_models):
    path = tiny_models["llama"]
    one = _load(path)
    two = _load(path, "cpu,cpu", "1,2")
    assert [(a, b) for _, a, b in two.model.stages] == [(0, 1), (1, 3)]
    ids = torch.tensor(one.tokenizer.encode(TEXT))
    kv1, kv2 = _kv(one), _kv(two)
    a = one.model.forward_chunks([SeqChunk(0, 0, ids)], kv1)
    b = two.model.forward_chunks([SeqChunk(0, 0, ids)], kv2)
    assert torch.equal(a, b), f"max diff {_max_diff(a, b):.3g}"
    assert torch.equal(kv1.read(0, 0, len(ids)), kv2.read(0, 0, len(ids)))


def test_kv_written_by_prefill_is_what_transformers_caches(tiny_models):
    path = tiny_models["qwen3"]
    lm = _load(path)
    ids = torch.tensor(lm.tokenizer.encode(TEXT))
    kv = _kv(lm)
    lm.model.forward_chunks([SeqChunk(1, 0, ids)], kv)
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        cache = ref_model(ids[None], use_cache=True).past_key_values
    ours = kv.read(1, 0, len(ids))  # [layers, 2, tokens, kv_heads, head_dim]
    for layer in range(lm.config.n_layers):
        ref_k = cache.layers[layer].keys[0].transpose(0, 1)  # [tokens, kv_heads, head_dim]
        diff = _max_diff(ours[layer, 0], ref_k)
        assert diff <= TINY_ATOL, f"layer {layer}: keys differ from transformers' cache by {diff:.3g}"


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_conversion_loads_the_same_model(tmp_path, arch):
    """An unquantised GGUF written like llama.cpp's converter (q/k rows permuted for llama and mistral)
    gives the logits of the HF folder it came from."""
    gguf_path = write_tiny_gguf(tmp_path, arch, quantize=False)
    from_gguf, from_folder = _load(gguf_path), _load(os.path.join(tmp_path, f"tiny-{arch}"))
    ids = from_folder.tokenizer.encode(TEXT)
    assert from_gguf.tokenizer.encode(TEXT) == ids
    a = from_gguf.model.forward_chunks([SeqChunk(0, 0, torch.tensor(ids))], _kv(from_gguf), all_logits=True)[0]
    b = from_folder.model.forward_chunks([SeqChunk(0, 0, torch.tensor(ids))], _kv(from_folder), all_logits=True)[0]
    diff = _max_diff(a, b)
    assert diff <= TINY_ATOL, f"{arch}: GGUF vs HF folder max abs logit diff {diff:.3g}"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quantized_gguf_matches_transformers_gguf_loader(tmp_path, arch):
    gguf_path = write_tiny_gguf(tmp_path, arch, quantize=True)
    ours = _load(gguf_path)
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32
    ).eval()
    ids = torch.tensor(ours.tokenizer.encode(TEXT))
    with torch.no_grad():
        ref = ref_model(ids[None]).logits[0]
    got = ours.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(ours), all_logits=True)[0]
    diff = _max_diff(got, ref)
    assert diff <= TINY_ATOL, f"{arch}: Q8_0 GGUF vs transformers' GGUF loader max abs logit diff {diff:.3g}"


# ---------------------------------------------------------------- the embedded SmolLM2 GGUF


@pytest.fixture(scope="module")
def embedded():
    return _load("")


@pytest.fixture(scope="module")
def embedded_reference():
    path = embedded_model_path()
    folder, name = os.path.dirname(path), os.path.basename(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model, tokenizer


def test_embedded_gguf_logits_match_transformers(embedded, embedded_reference):
    ref_model, _ = embedded_reference
    prompt = embedded.tokenizer.render_chat([{"role": "user", "content": "What is the capital of France?"}])
    ids = torch.tensor(embedded.tokenizer.encode(prompt))
    with torch.no_grad():
        ref = ref_model(ids[None]).logits[0]
    ours = embedded.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(embedded), all_logits=True)[0]
    diff = _max_diff(ours, ref)
    assert diff <= EMBEDDED_ATOL, f"embedded GGUF: max abs logit diff {diff:.3g} > {EMBEDDED_ATOL}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize(
    "text",
    [
        "Hello world!",
        "  leading spaces,\ttabs\n\nand newlines",
        "café naïve 東京 Ünïcödé",
        "emoji 🙂🚀 and a family 👨\u200d👩\u200d👧",
        "def f(x):\n    return x ** 2  # square\n",
        "Numbers 12345, 3.14159 and 1e-9",
        "don't won't I'M",
        "<|im_start|>user\nhi<|im_end|>\n",
    ],
)
def test_embedded_tokenizer_matches_transformers(embedded, embedded_reference, text):
    _, ref_tok = embedded_reference
    ours = embedded.tokenizer.encode(text)
    assert ours == ref_tok.encode(text, add_special_tokens=False)
    assert embedded.tokenizer.decode(ours, skip_special_tokens=False) == text


@pytest.mark.parametrize("backend", ["onednn", "blas"])
def test_greedy_decode_is_identical_alone_and_batched(embedded, backend, monkeypatch):
    """A slot's logits are bitwise the same whatever it is batched with (prefills, decodes, both),
    through oneDNN and through the BLAS fallback (what runs where oneDNN does not)."""
    import engine.model.projections as projections

    if backend == "blas":
        monkeypatch.setattr(projections, "_ONEDNN", False)
    elif not projections._ONEDNN:
        pytest.skip("this torch build has no oneDNN")
    model, tok = embedded.model, embedded.tokenizer
    prompt = torch.tensor(tok.encode(tok.render_chat([{"role": "user", "content": "Name three colours."}])))
    other = torch.tensor(tok.encode("The history of the Roman empire begins"))
    steps = 8

    def run(batched: bool) -> tuple[list[int], list[torch.Tensor]]:
        kv = _kv(embedded, n_slots=3, ctx=512)
        chunks = [SeqChunk(0, 0, prompt)]
        if batched:
            chunks += [SeqChunk(1, 0, other[:3]), SeqChunk(2, 0, other)]
        logits = model.forward_chunks(chunks, kv)
        tokens, rows = [int(logits[0].argmax())], [logits[0]]
        pos, other_pos = len(prompt), {1: 3, 2: len(other)}
        for step in range(steps):
            chunks = [SeqChunk(0, pos, torch.tensor([tokens[-1]]))]
            if batched and step % 3 == 0:  # others decode one token each
                chunks += [SeqChunk(s, p, torch.tensor([7])) for s, p in other_pos.items()]
                other_pos = {s: p + 1 for s, p in other_pos.items()}
            elif batched and step % 3 == 1:  # one other decodes: two rows in all
                chunks.append(SeqChunk(2, other_pos[2], torch.tensor([9])))
                other_pos[2] += 1
            elif batched:  # a fresh prefill of mixed length rides along
                chunks.insert(0, SeqChunk(1, other_pos[1], other[: 2 + step]))
                other_pos[1] += 2 + step
            logits = model.forward_chunks(chunks, kv)
            mine = next(i for i, ch in enumerate(chunks) if ch.slot == 0)
            rows.append(logits[mine])
            tokens.append(int(logits[mine].argmax()))
            pos += 1
        return tokens, rows

    alone_tokens, alone_rows = run(batched=False)
    batched_tokens, batched_rows = run(batched=True)
    assert alone_tokens == batched_tokens
    for step, (a, b) in enumerate(zip(alone_rows, batched_rows, strict=True)):
        assert torch.equal(a, b), f"step {step}: logits differ by {_max_diff(a, b):.3g} when batched"


@pytest.mark.parametrize("single", [True, False], ids=["one-token-chunk-rows", "prefill-rows"])
@pytest.mark.parametrize("backend", ["onednn", "blas"])
def test_projection_rows_do_not_depend_on_row_count(embedded, single, backend, monkeypatch):
    """The primitive behind batch invariance: a row's product is bitwise the same for any number of rows."""
    import engine.model.projections as projections
    from engine.model.projections import linear

    if backend == "blas":
        monkeypatch.setattr(projections, "_ONEDNN", False)
    elif not projections._ONEDNN:
        pytest.skip("this torch build has no oneDNN")

    w = embedded.model.layers[0].w_gate_up
    rows = torch.randn(40, w.shape[1], generator=torch.Generator().manual_seed(0))
    counts = [1, 2, 3, 4, 5, 8, 17, 40] if single else [2, 3, 4, 5, 8, 17, 40]
    with torch.inference_mode():
        ref = linear(rows[: counts[0]], w, counts[0] if single else 0)[0]
        for m in counts[1:]:
            got = linear(rows[:m], w, m if single else 0)[0]
            assert torch.equal(got, ref), f"{m} rows: first row differs by {_max_diff(got, ref):.3g}"


def test_decode_logits_are_the_same_with_and_without_all_logits(embedded):
    ids = torch.tensor(embedded.tokenizer.encode("One two three four five"))
    rows = []
    for all_logits in (False, True):
        kv = _kv(embedded)
        embedded.model.forward_chunks([SeqChunk(0, 0, ids[:-1])], kv)
        out = embedded.model.forward_chunks([SeqChunk(0, len(ids) - 1, ids[-1:])], kv, all_logits=all_logits)
        rows.append(out[0].reshape(-1))
    assert torch.equal(rows[0], rows[1])
