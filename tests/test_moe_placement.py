"""Expert placement (`--moe-experts`, `--moe-cpu-layers`): which layers' experts go to host RAM, the split model
against transformers and against the all-float model, prefill grouped by expert, and the refusals.

This machine has no GPU, so the model's device is the CPU here: the placed layers' experts are still built apart
(in host RAM, as 4-bit groups) while the other layers keep float experts, which is the code path a GPU model
takes; only the copies of the hidden states between devices do not happen.
"""

from __future__ import annotations

import logging

import pytest
import torch

from engine.config import EngineConfig
from engine.kv import KVBuffers, KVLayout
from engine.model import SeqChunk, int4, load_model, moe, moe_placement, plan_stages
from engine.model.loader import read_model_config
from engine.model.moe_loading import routed_expert_weights
from engine.runtime.engine import Engine
from tests.model_fixtures import write_tiny_model
from tests.moe_fixtures import N_EXPERTS, TOP_K, write_tiny_moe_model
from tools.conversation_cache_parity import run_restart, run_scenario

transformers = pytest.importorskip("transformers")
transformers.utils.logging.disable_progress_bar()
needs_int4 = pytest.mark.skipif(not int4.available(), reason="this torch has no CPU int4 kernels")

TEXT = "The quick brown fox jumps over the lazy dog. def add(a, b): return a + b  café 🙂 " * 2 + "Paris is"


def _load(path: str, cpu_experts: frozenset[int] = frozenset()):
    stages = plan_stages(read_model_config(path).n_layers, "cpu", "")
    return load_model(path, stages, torch.float32, cpu_experts=cpu_experts)


def _kv(lm) -> KVBuffers:
    c = lm.config
    return KVBuffers(KVLayout(c.n_layers, c.n_kv_heads, c.head_dim, lm.dtype), 2, 256, lm.model.stages)


@pytest.fixture(scope="module")
def grid_models(tmp_path_factory) -> dict[str, str]:
    """Weights on a 4-bit grid, so 4-bit experts lose nothing but the kernel's bfloat16 activations."""
    root = tmp_path_factory.mktemp("placement")
    return {arch: write_tiny_moe_model(root, arch, int4_grid=True) for arch in ("qwen3_moe", "qwen2_moe")}


def test_flags_pick_the_layers_whose_experts_go_to_the_cpu(grid_models, tmp_path, caplog):
    config = read_model_config(grid_models["qwen3_moe"])  # 3 layers, layer 1 dense (mlp_only_layers)
    layers = moe_placement.cpu_expert_layers
    assert layers(config, "gpu", 0) == frozenset()
    assert layers(config, "gpu", 1) == layers(config, "gpu", 2) == {0}  # N counts layers, dense ones too
    assert layers(config, "gpu", 3) == layers(config, "cpu", 0) == {0, 2}
    with pytest.raises(ValueError, match=r"--moe-cpu-layers 4: the model has 3 layers; expected 0 to 3"):
        layers(config, "gpu", 4)
    with pytest.raises(ValueError, match=r"--moe-experts cpu already puts every layer's experts on the CPU"):
        layers(config, "cpu", 2)
    with pytest.raises(ValueError, match=r"the experts of 2 layers need about 0 MiB of host RAM as 4-bit groups, "
                       r"only 0 MiB is available; place fewer layers on the CPU"):
        moe_placement.check_cpu_experts(config, layers(config, "cpu", 0), available=1000)
    moe_placement.check_cpu_experts(config, layers(config, "cpu", 0), available=1 << 30)
    dense = read_model_config(write_tiny_model(tmp_path, "llama"))
    with caplog.at_level(logging.WARNING, logger="strata.engine"):
        assert layers(dense, "cpu", 0) == layers(dense, "gpu", 7) == frozenset()
    assert sum("ignored: llama has no experts" in r.getMessage() for r in caplog.records) == 2


@needs_int4
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_first_layer_on_the_cpu_int4_the_rest_float_as_before(grid_models, arch):
    """`--moe-cpu-layers 1` with float weights elsewhere: layer 0's routed experts are 4-bit groups in host RAM
    (the shared expert stays float, where the layer runs); every other layer's expert block is bit for bit the
    float model's; the whole model stays within int4's tolerance of transformers."""
    path = grid_models[arch]
    float_lm, split_lm = _load(path), _load(path, frozenset({0}))
    placed, rest = split_lm.model.layers[0].moe, split_lm.model.layers[1:]
    assert all(isinstance(w, int4.Int4Weight) for w in (*placed.gate_up, *placed.down))
    assert len(placed.gate_up) == N_EXPERTS and placed.expert_device.type == "cpu"
    assert isinstance(placed.router, torch.Tensor)
    if arch == "qwen2_moe":
        assert isinstance(placed.shared_gate_up, torch.Tensor) and isinstance(placed.shared_down, torch.Tensor)
    h = torch.randn(40, split_lm.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        for i, layer in enumerate(rest, start=1):
            if layer.moe is not None:
                assert isinstance(layer.moe.down, torch.Tensor), i
                assert torch.equal(layer.moe(h, 0), float_lm.model.layers[i].moe(h, 0)), f"layer {i} changed"
        want, got = float_lm.model.layers[0].moe(h, 0), placed(h, 0)
    relative = ((got - want).norm() / want.norm()).item()
    assert 0 < relative < 0.03, f"{arch}: int4 experts change layer 0's block by {relative:.3f} (relative)"

    ids = torch.tensor(split_lm.tokenizer.encode(TEXT))
    with torch.inference_mode():
        ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(ids[None]).logits[0]
        ours = split_lm.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(split_lm), all_logits=True)[0]
        exact = float_lm.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(float_lm), all_logits=True)[0]
    assert (exact - ref).abs().max().item() <= 1e-4  # float experts: transformers' logits
    # bfloat16 activations move a row by ~1%; a position whose top-2 experts nearly tie can switch expert and
    # move further (3 of 90 here), as any int4 MoE kernel (llama.cpp's included) does.
    error = (ours - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert error.median().item() < 0.02, f"{arch}: median relative logit error {error.median():.3f}"
    assert (error > 0.05).float().mean().item() <= 0.05, f"{arch}: {(error > 0.05).sum()} positions far off"
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9


@needs_int4
def test_the_arena_counts_experts_in_host_ram_and_the_identity_tells_placements_apart(grid_models):
    path = grid_models["qwen3_moe"]
    float_lm, split_lm = _load(path), _load(path, frozenset({0}))
    layer0 = split_lm.model.layers[0].moe.expert_bytes
    # Layer 0's experts as 4-bit groups, layer 2's still float32: on a CPU model both are in host RAM.
    assert layer0 < float_lm.model.layers[0].moe.expert_bytes / 5
    assert layer0 == routed_expert_weights(split_lm.config) * moe_placement.INT4_BYTES_PER_WEIGHT  # the estimate
    assert moe_placement.arena_bytes(split_lm.model.layers) == layer0 + float_lm.model.layers[2].moe.expert_bytes
    assert moe_placement.describe(split_lm.model.layers) == {"experts": ["0:cpu:int4", "2:cpu:float"]}
    assert moe_placement.describe(float_lm.model.layers) == {"experts": ["0:cpu:float", "2:cpu:float"]}


@pytest.mark.parametrize("cpu_experts", [frozenset(), frozenset({0})], ids=["float", "layer0-int4"])
def test_prefill_runs_each_chosen_expert_once_over_all_its_tokens(grid_models, monkeypatch, cpu_experts):
    """A prefill of ~90 tokens makes one expert call (one matmul pair) per expert the router chose in a layer,
    over all the rows routed to it, not one per token: counted by wrapping the block's expert MLP."""
    if cpu_experts and not int4.available():
        pytest.skip("this torch has no CPU int4 kernels")
    lm = _load(grid_models["qwen3_moe"], cpu_experts)
    calls: list[int] = []
    chosen: list[int] = []
    real_mlp, real_route = moe._mlp, moe.route

    def counting_mlp(x, gate_up, down, n_single, **options):
        calls.append(x.shape[0])
        return real_mlp(x, gate_up, down, n_single, **options)

    def recording_route(logits, config, bias=None):
        weights, experts = real_route(logits, config, bias)
        chosen.append(len(torch.unique(experts)))
        return weights, experts

    monkeypatch.setattr(moe, "_mlp", counting_mlp)
    monkeypatch.setattr(moe, "route", recording_route)
    ids = torch.tensor(lm.tokenizer.encode(TEXT))
    lm.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(lm))
    n_moe_layers = 2  # layers 0 and 2
    assert len(chosen) == n_moe_layers
    assert len(calls) == sum(chosen) <= n_moe_layers * N_EXPERTS < n_moe_layers * len(ids) * TOP_K
    # Every (token, expert) pair is one row of one call; rows are padded to whole blocks of 4.
    assert sum(calls) - n_moe_layers * len(ids) * TOP_K in range(0, 4 * len(calls))


def test_engine_refuses_layers_the_model_does_not_have(grid_models):
    config = EngineConfig(model=grid_models["qwen3_moe"], moe_cpu_layers=5, conversation_cache_mib=0)
    with pytest.raises(ValueError, match=r"--moe-cpu-layers 5: the model has 3 layers; expected 0 to 3"):
        Engine.from_config(config)
    with pytest.raises(ValueError, match=r"--moe-experts: expected one of gpu, cpu"):
        EngineConfig(moe_experts="disk")


@needs_int4
@pytest.mark.parametrize("storage", ["disk", "tiered"])
def test_a_conversation_with_cpu_experts_parks_and_restores_exactly_across_a_restart(grid_models, storage):
    """A/B/A with every layer's experts placed on the CPU (4-bit) and float weights elsewhere: A restored after
    B gives the tokens of A run straight through, in the same engine and in a new one."""
    base = {"model": grid_models["qwen2_moe"], "ctx_size": 2048, "devices": "cpu", "cpu_weights": "float",
            "moe_experts": "cpu", "conversation_cache_storage": storage, "conversation_cache_min_free_mib": 0}
    outcome = run_scenario("basic", base, n_words=60, max_tokens=12)
    assert outcome.passed, outcome.detail
    outcome = run_restart(base, {}, n_words=60, max_tokens=12)
    assert outcome.passed, outcome.detail


@needs_int4
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (not run on the CPU-only machine)")
def test_experts_in_host_ram_beside_a_gpu_model(grid_models):
    """On a GPU: layer 0's experts in host RAM (4-bit groups, run on the CPU), the rest on the GPU; the hidden
    states go to the CPU and back, and the model stays within int4's tolerance of transformers."""
    path = grid_models["qwen2_moe"]
    stages = plan_stages(read_model_config(path).n_layers, "cuda:0", "")
    lm = load_model(path, stages, torch.float32, cpu_experts=frozenset({0}))
    placed, other = lm.model.layers[0].moe, lm.model.layers[1].moe
    assert placed.expert_device.type == "cpu" and other.expert_device.type == "cuda"
    assert placed.router.device.type == "cuda" and placed.shared_gate_up.device.type == "cuda"
    assert moe_placement.arena_bytes(lm.model.layers) == placed.expert_bytes
    ids = torch.tensor(lm.tokenizer.encode(TEXT))
    with torch.inference_mode():
        ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(ids[None]).logits[0]
        ours = lm.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(lm), all_logits=True)[0].cpu()
    error = (ours - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert error.median().item() < 0.02 and (ours.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9
