"""A GGUF read onto a CUDA device through pinned pieces (engine/model/read_staging.py) is the same model as read
onto the CPU: the same weights' fingerprint (the hash sees the same bytes in the same order) and the same logits.
On a CUDA GPU only (`-m gpu`)."""

from __future__ import annotations

import pytest
import torch

from engine.kv import KVBuffers, KVLayout
from engine.model import SeqChunk, load_model, read_staging
from engine.model.loader import read_model_config
from tests.model_fixtures import write_tiny_gguf

CUDA = torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (not run on the CPU-only machine)")
def test_a_gguf_read_onto_the_gpu_in_pieces_is_the_model_read_onto_the_cpu(tmp_path, monkeypatch):
    path = write_tiny_gguf(tmp_path)
    monkeypatch.setattr(read_staging, "PIECE_BYTES", 4096)  # many pieces per tensor, the ring reused many times
    n = read_model_config(path).n_layers
    cpu = load_model(path, [(torch.device("cpu"), 0, n)], torch.float32)
    gpu = load_model(path, [(torch.device("cuda:0"), 0, n)], torch.float32)
    assert gpu.fingerprint == cpu.fingerprint
    ids = torch.randint(3, cpu.config.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        a, b = (lm.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(lm), all_logits=True)[0].cpu() for lm in (cpu, gpu))
    assert torch.allclose(a, b, atol=1e-3), f"CPU and GPU logits differ by {(a - b).abs().max():.3g}"


def _kv(lm) -> KVBuffers:
    c = lm.config
    return KVBuffers(KVLayout(c.n_layers, c.n_kv_heads, c.head_dim, lm.dtype), 1, 64, lm.model.stages)
