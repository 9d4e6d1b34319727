"""`--gpu-weights`: the refusals everywhere, and on a CUDA GPU (`-m gpu`) the 4-bit weights' kernel against the
dequantised weight, a small model's logits against bf16, and captured decode against the eager step.

Tolerance stated by these tests: one projection differs from x @ dequantised(w).T by under 1% (relative); on a
small random model whose weights already lie on the 4-bit grid (so quantising loses nothing and only the kernel's
bfloat16 scales, zero points and sums differ), the median relative logit difference from the bf16 model is below
10% (0.051 measured on an H200: a random model's layers amplify each projection's ~0.3% difference).
"""

from __future__ import annotations

import glob
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.cli import parse_config
from engine.config import EngineConfig
from engine.kv import KVBuffers, KVLayout
from engine.model import SeqChunk, gpu_weights, load_model, plan_stages
from engine.model.graph_decode import configure, unsupported
from engine.model.loader import read_model_config
from engine.runtime.engine import Engine
from tests.model_fixtures import write_tiny_model

CUDA = torch.cuda.is_available()
cuda_only = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (not run on the CPU-only machine)")


def test_flag_choices_and_refusals(tmp_path):
    assert EngineConfig().gpu_weights == "auto" and parse_config(["--gpu-weights", "int4"]).gpu_weights == "int4"
    with pytest.raises(ValueError, match=r"--gpu-weights: expected one of auto, bf16, int4"):
        EngineConfig(gpu_weights="int8")
    assert gpu_weights.resolve("auto", torch.bfloat16, True) == gpu_weights.resolve("bf16", torch.float32, False) == "bf16"
    with pytest.raises(ValueError, match=r"--gpu-weights int4: needs --dtype bfloat16 \(or auto\), got float16"):
        gpu_weights.resolve("int4", torch.float16, True)
    model = write_tiny_model(tmp_path, "llama")
    with pytest.raises(ValueError, match=r"--gpu-weights int4: only for models on a CUDA device"):
        Engine.from_config(EngineConfig(model=model, devices="cpu", gpu_weights="int4", conversation_cache_mib=0))


def _snap_to_grid(w: torch.Tensor) -> torch.Tensor:
    """w with every group of GROUP values on its own 4-bit grid (what CudaInt4Weight then holds exactly)."""
    n, k = w.shape
    g = w.float().view(n, k // gpu_weights.GROUP, gpu_weights.GROUP)
    low, high = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = (high - low) / 15
    return (((g - low) / scale).round() * scale + low).view(n, k).to(torch.bfloat16).to(w.dtype)


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("rows", [1, 8, 64])
def test_kernel_matches_the_dequantised_weight(rows):
    gen = torch.Generator(device="cuda").manual_seed(rows)
    w = torch.randn(1024, 2048, device="cuda", generator=gen).bfloat16()
    x = torch.randn(rows, 2048, device="cuda", generator=gen).bfloat16()
    snapped = _snap_to_grid(w)
    got = gpu_weights.CudaInt4Weight(snapped)(x).float()
    want = x.float() @ snapped.float().T
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert ((got - want).norm() / want.norm()).item() < 1e-2


@pytest.fixture(scope="module")
def grid_model(tmp_path_factory) -> str:
    """A small llama whose projection and output weights lie on the 4-bit grid (hidden 256, groups fit)."""
    folder = write_tiny_model(tmp_path_factory.mktemp("gpuw"), "llama", hidden_size=256, intermediate_size=512,
                              num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    for path in glob.glob(os.path.join(folder, "*.safetensors")):
        tensors = load_file(path)
        for name, t in tensors.items():
            if t.dim() == 2 and "embed" not in name and t.shape[1] % gpu_weights.GROUP == 0:
                tensors[name] = _snap_to_grid(t)
        save_file(tensors, path, metadata={"format": "pt"})
    return folder


def _load_cuda(path: str):
    return load_model(path, plan_stages(read_model_config(path).n_layers, "cuda:0", ""), torch.bfloat16)


def _kv(lm, slots: int, ctx: int) -> KVBuffers:
    c = lm.config
    return KVBuffers(KVLayout(c.n_layers, c.n_kv_heads, c.head_dim, lm.dtype), slots, ctx, lm.model.stages)


def _greedy(lm, prompts: list[torch.Tensor], n: int) -> list[list[int]]:
    kv = _kv(lm, len(prompts), 256)
    tokens = [int(lm.model.forward_chunks([SeqChunk(s, 0, p)], kv)[0].argmax()) for s, p in enumerate(prompts)]
    out = [[t] for t in tokens]
    for step in range(n):
        chunks = [SeqChunk(s, len(p) + step, torch.tensor([t])) for s, (p, t) in enumerate(zip(prompts, tokens, strict=True))]
        tokens = lm.model.forward_chunks(chunks, kv).argmax(-1).tolist()
        for s, t in enumerate(tokens):
            out[s].append(t)
    return out


@pytest.mark.gpu
@cuda_only
def test_int4_model_logits_and_captured_decode(grid_model):
    ref, lm = _load_cuda(grid_model), _load_cuda(grid_model)
    before, after = gpu_weights.quantize_model(lm.model)
    assert 0 < after < before / 3
    assert isinstance(lm.model.lm_head, gpu_weights.CudaInt4Weight) and unsupported(lm.model) is None
    ids = torch.randint(0, 512, (200,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = ref.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(ref, 1, 256), all_logits=True)[0].float()
        got = lm.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(lm, 1, 256), all_logits=True)[0].float()
        error = (got - want).norm(dim=-1) / want.norm(dim=-1)
        assert error.median().item() < 0.1, f"median relative logit difference {error.median():.4f}"
        prompts = [torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 17, 40)]
        configure(lm.model, 4, cuda_graphs=False, deterministic=False)
        eager = _greedy(lm, prompts, 24)
        configure(lm.model, 4, cuda_graphs=True, deterministic=False)
        graphs = _greedy(lm, prompts, 24)
        assert lm.model.graphs is not None and lm.model.graphs.replays >= 24
    assert graphs == eager
