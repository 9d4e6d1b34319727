"""A prefill chunk's experts brought from host RAM to the layer's GPU (engine/model/moe_offload.py): the experts the
file holds as Q4_K / Q6_K / Q8_0 blocks are decoded on the device to gguf's own values, a group of experts at a
time, and their rows' sum is the one the CPU's kernels give (within their int16 activations' rounding). The device
path is checked on the CPU, where it runs the same code; on CUDA a served prompt of more than 32 tokens takes it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.model import load_model, plan_stages
from engine.model.loader import read_model_config
from engine.model.moe import grouped_experts, route
from engine.model.moe_offload import OFFLOAD_MIN_ROWS, DeviceExperts, file_type, offloadable
from tests.moe_fixtures import N_EXPERTS, write_tiny_moe_gguf

gguf = pytest.importorskip("gguf")

SIZES = {"hidden_size": 256, "moe_intermediate_size": 256}  # Q4_K blocks span 256 values of a row
LAYER = 2  # an expert layer of the tiny Qwen3-MoE (its layer 1 is dense)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """Layer 2's expert block of a file with Q4_K gate/up and Q6_K down stacks, the experts in host RAM."""
    from engine.model import kquant_weight

    if not kquant_weight.available():
        pytest.skip("the native kernels do not load here: K-quant experts become 4-bit groups")
    path = write_tiny_moe_gguf(tmp_path_factory.mktemp("offload"), "qwen3_moe",
                               expert_types={"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"}, **SIZES)
    stages = plan_stages(read_model_config(path).n_layers, "cpu", "")
    lm = load_model(path, stages, torch.float32, cpu_experts=frozenset({0, 2}))
    return path, lm.model.layers[LAYER].moe


def _file_values(path: str, part: str) -> torch.Tensor:
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == f"blk.{LAYER}.ffn_{part}_exps.weight")
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type)))


def test_the_file_blocks_decode_on_the_device_to_ggufs_values_a_group_at_a_time(moe):
    path, block = moe
    assert (file_type(block.gate_up).name, file_type(block.down).name) == ("Q4_K", "Q6_K")
    assert offloadable(block.gate_up, block.down)
    here = DeviceExperts(block.gate_up, block.down, torch.device("cpu"), torch.float32, group_bytes=1)
    assert here.group == 1  # every expert its own group: the switches between groups are exercised
    gate, up, down = (_file_values(path, part) for part in ("gate", "up", "down"))
    for e in range(N_EXPERTS):
        gate_up, down_e = here.weights(e)
        assert torch.equal(gate_up, torch.cat((gate[e], up[e])))
        assert torch.equal(down_e, down[e])
    assert not offloadable([torch.zeros(1)], block.down), "float stacks stay where they are"


def test_a_chunk_routed_through_the_decoded_experts_sums_as_the_cpu_kernels_do(moe):
    _, block = moe
    torch.manual_seed(0)
    h = torch.randn(OFFLOAD_MIN_ROWS + 5, SIZES["hidden_size"])
    weights, experts = route(h @ block.router[: N_EXPERTS].T, block.config)
    on_cpu = grouped_experts(h, experts, weights, 0, N_EXPERTS,
                             lambda x, e, n_one: _swiglu(x, block.gate_up[e].mm, block.down[e].mm))
    here = DeviceExperts(block.gate_up, block.down, torch.device("cpu"), torch.float32, group_bytes=3 << 20)
    assert 1 < here.group < N_EXPERTS

    def run(x, e, n_one):
        gate_up, down = here.weights(e)
        return _swiglu(x, lambda v: v @ gate_up.T, lambda v: v @ down.T)

    offloaded = grouped_experts(h, experts, weights, 0, N_EXPERTS, run)
    # The CPU kernels round the activations to int16 per block; the decoded weights are the file's exactly.
    assert ((offloaded - on_cpu).norm() / on_cpu.norm()).item() < 1e-2


def _swiglu(x, gate_up, down):
    gu = gate_up(x)
    inter = gu.shape[1] // 2
    return down(torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_long_prompts_experts_run_on_the_gpu_and_agree_with_the_cpu_ones(moe):
    path, _ = moe
    from engine.kv import KVBuffers, KVLayout
    from engine.model import SeqChunk

    stages = plan_stages(read_model_config(path).n_layers, "cuda:0", "")
    lm = load_model(path, stages, torch.bfloat16, cpu_experts=frozenset({0, 2}))
    c = lm.config
    ids = torch.arange(100, 100 + 3 * OFFLOAD_MIN_ROWS)

    def logits(batch_invariant: bool) -> torch.Tensor:
        lm.model.batch_invariant = batch_invariant  # the --deterministic path keeps every row on the CPU experts
        kv = KVBuffers(KVLayout(c.n_layers, c.n_kv_heads, c.head_dim, lm.dtype), 1, 128, lm.model.stages)
        return lm.model.forward_chunks([SeqChunk(0, 0, ids)], kv, all_logits=True)[0].float()

    calls = []
    real = DeviceExperts.weights

    def counted(self, e):
        calls.append(e)
        return real(self, e)

    DeviceExperts.weights = counted  # type: ignore[method-assign]
    try:
        fast = logits(False)
        assert calls, "the chunk's experts ran on the GPU"
        calls.clear()
        exact = logits(True)
        assert not calls
    finally:
        DeviceExperts.weights = real  # type: ignore[method-assign]
    assert ((fast - exact).norm() / exact.norm()).item() < 0.05  # bfloat16 GEMMs against float32 kernels
