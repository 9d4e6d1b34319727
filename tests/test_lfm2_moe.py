"""LFM2-MoE beyond the per-family parity of test_hybrid_models.py and test_hybrid_cache_parity.py: its sigmoid
router with the expert bias, where its expert blocks sit, its routed experts in host RAM (`--moe-cpu-layers`)
with a parked conversation still restored exactly, the identity of the MoE families from before its routing,
and configurations it cannot describe refused with the reason."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine.errors import ModelLoadError
from engine.model import int4, load_model
from engine.model.loader import read_model_config
from engine.model.moe import route
from engine.model.moe_config import MoeConfig
from tests.hybrid_fixtures import one_thread, write_tiny_hybrid  # noqa: F401 (fixture)

CPU = [(torch.device("cpu"), 0, 4)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return write_tiny_hybrid(tmp_path_factory.mktemp("lfm2-moe"), "lfm2_moe")


def test_the_bias_chooses_the_experts_and_the_scores_weigh_them():
    moe = MoeConfig(n_experts=4, top_k=2, expert_size=8, routing="sigmoid_bias", norm_topk_prob=True,
                    routed_scaling=2.0, norm_eps=1e-6)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])  # expert 3 has the lowest score but is chosen first
    weights, experts = route(logits, moe, bias)
    assert experts.tolist() == [[3, 0]]
    scores = torch.sigmoid(logits[0, [3, 0]])
    assert torch.allclose(weights[0], 2.0 * scores / (scores.sum() + 1e-6))


def test_expert_blocks_follow_the_dense_layers_and_the_router_settings_come_from_the_config(folder):
    lm = load_model(folder, CPU, torch.float32)
    assert [layer.moe is not None for layer in lm.model.layers] == [False, True, True, True]
    moe = lm.config.moe
    assert (moe.n_experts, moe.top_k, moe.expert_size, moe.routing) == (6, 2, 32, "sigmoid_bias")
    assert (moe.routed_scaling, moe.norm_eps, moe.norm_topk_prob) == (1.5, 1e-6, True)
    bias = lm.model.layers[1].moe.expert_bias
    assert bias.dtype == torch.float32 and bias.abs().sum() > 0  # the fixture's random bias, kept in float32
    # the MoE families from before this routing describe themselves as they did (their parked K/V stays theirs)
    old = MoeConfig(n_experts=4, top_k=2, expert_size=8, routing="softmax_topk", norm_topk_prob=True)
    assert "routed_scaling" not in old.describe() and "norm_eps" not in old.describe()
    assert lm.config.describe()["moe"]["routed_scaling"] == 1.5


@pytest.mark.skipif(not int4.available(), reason="this torch has no CPU int4 kernels")
def test_experts_in_host_ram_as_4_bit_groups_and_a_parked_conversation_resumes_exactly(folder):
    from engine.model import moe_placement
    from tools.conversation_cache_parity import run_scenario

    shape = read_model_config(folder)
    assert moe_placement.cpu_expert_layers(shape, "gpu", 3) == {1, 2}  # layers 0-2; layer 0 has a dense MLP
    lm = load_model(folder, CPU, torch.float32, cpu_experts=frozenset({1, 2}))
    assert all(isinstance(w, int4.Int4Weight) for w in lm.model.layers[1].moe.gate_up)
    assert isinstance(lm.model.layers[3].moe.gate_up, torch.Tensor)
    base = {"model": folder, "devices": "cpu", "ctx_size": 512, "cpu_weights": "float", "moe_cpu_layers": 3,
            "conversation_cache_storage": "disk", "conversation_cache_min_free_mib": 0, "prefill_chunk": 32,
            "conversation_cache_checkpoint_tokens": 64}
    outcome = run_scenario("basic", base, n_words=40, max_tokens=8)
    assert outcome.passed, outcome.detail


@pytest.mark.parametrize(("change", "message"), [
    ({"num_dense_layers": 9}, r"num_dense_layers: expected 0 to 4, got 9"),
    ({"num_experts_per_tok": 8}, r"num_experts_per_tok \(8\) exceeds the number of experts \(6\)"),
    ({"routed_scaling_factor": 0}, "routed_scaling_factor: expected a positive number"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
])
def test_configs_the_experts_cannot_describe_are_refused_with_the_reason(folder, tmp_path, change, message):
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    cfg = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ModelLoadError, match=message):
        read_model_config(str(copy))


def test_a_gguf_with_softmax_gating_is_refused(tmp_path):
    import gguf

    from tests.hybrid_fixtures import write_tiny_hybrid_gguf

    path = write_tiny_hybrid_gguf(tmp_path, "lfm2_moe")
    assert read_model_config(path).moe.routing == "sigmoid_bias"
    reader = gguf.GGUFReader(path, "r+")
    field = reader.fields["lfm2moe.expert_gating_func"]
    field.parts[field.data[0]][0] = 1  # softmax, written in place
    del reader
    with pytest.raises(ModelLoadError, match=r"expert_gating_func 1: expected 2 \(sigmoid\)"):
        read_model_config(path)
