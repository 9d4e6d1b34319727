"""Gemma 4's expert block (`enable_moe_block`) in host RAM (`--moe-experts cpu`, `--moe-cpu-layers N`): the shared
expert block's placement, arena and identity, the logits against the all-on-device model and transformers (one
shot, chunked prefill, decode), from the folder and from the GGUF (the file's own blocks), and a parked
conversation with its experts in RAM.

As tests/test_moe_placement.py says, this machine has no GPU: the model's device is the CPU, and the placed
layers' experts are built apart (in host RAM, as 4-bit groups or the file's blocks) as a GPU model's are. The
folder's experts lie on a 4-bit grid, so packing them loses only the kernel's bfloat16 activations.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from engine.kv import KVBuffers, KVLayout
from engine.model import SeqChunk, int4, kquant_weight, load_model, moe_placement, plan_stages
from engine.model.gemma4_experts import routed_config
from engine.model.gguf_dequant import q4_groups
from engine.model.loader import read_model_config
from engine.model.moe_config import MoeConfig
from engine.model.moe_loading import routed_expert_weights
from engine.model.planning import layer_bytes
from engine.model.q8_weight import Q8Weight
from tests.int4_kernels import dense, implied
from tests.model_fixtures import write_tiny_gguf
from tools.conversation_cache_parity import run_restart, run_scenario

transformers = pytest.importorskip("transformers")
transformers.utils.logging.disable_progress_bar()
needs_int4 = pytest.mark.skipif(not int4.available(), reason="this torch has no CPU int4 kernels")

TEXT = "The quick brown fox jumps over the lazy dog. def add(a, b): return a + b  café 🙂 " * 2
EXPERTS = {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32}
N_LAYERS = 6
# The GGUF's expert stacks as Q8_0 blocks (llama.cpp's names), which experts in host RAM keep as they are.
Q8_EXPERTS = {f"blk.{i}.{name}": "Q8_0" for i in range(N_LAYERS)
              for name in ("ffn_gate_up_exps.weight", "ffn_down_exps.weight")}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> tuple[str, str]:
    """(the folder, the GGUF of its weights with Q8_0 experts)."""
    root = tmp_path_factory.mktemp("gemma4-moe")
    gguf_path = write_tiny_gguf(root, "gemma4", quantize=False, tensor_types=Q8_EXPERTS, int4_grid_experts=True,
                                **EXPERTS)
    return os.path.join(root, "tiny-gemma4"), gguf_path


def _load(path: str, cpu_experts: frozenset[int] = frozenset()):
    stages = plan_stages(read_model_config(path).n_layers, "cpu", "")
    return load_model(path, stages, torch.float32, cpu_experts=cpu_experts)


def _kv(lm) -> KVBuffers:
    c = lm.config
    return KVBuffers(KVLayout(c.kv_layers, *c.kv_row, lm.dtype), 2, 256,
                     [(d, a, min(b, c.kv_layers)) for d, a, b in lm.model.stages if a < c.kv_layers])


def _close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """int4 experts' usual tolerance (tests/test_moe_placement.py): bfloat16 activations move a row by ~1%."""
    error = (ours - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert error.median().item() < 0.02, f"{what}: median relative logit error {error.median():.3f}"
    assert (error > 0.05).float().mean().item() <= 0.05, f"{what}: {(error > 0.05).sum()} positions far off"
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9, what


def test_the_flags_place_the_block_beside_every_mlp(files):
    """Every Gemma 4 layer has the block: `--moe-experts cpu` places all six, `--moe-cpu-layers 2` the first two;
    the stage planner then leaves those experts out of the layer's device bytes."""
    config = read_model_config(files[0])
    layers = moe_placement.cpu_expert_layers
    assert layers(config, "cpu", 0) == frozenset(range(N_LAYERS))
    assert layers(config, "gpu", 2) == {0, 1} and layers(config, "gpu", 0) == frozenset()
    with pytest.raises(ValueError, match=r"--moe-cpu-layers 7: the model has 6 layers; expected 0 to 6"):
        layers(config, "gpu", 7)
    with pytest.raises(ValueError, match=r"the experts of 6 layers need about 0 MiB of host RAM"):
        moe_placement.check_cpu_experts(config, layers(config, "cpu", 0), available=1000)
    assert routed_expert_weights(config) == 4 * 3 * config.hidden_size * 32
    on_device = layer_bytes(config, torch.float32, 1, 0)
    in_ram = layer_bytes(config, torch.float32, 1, 0, frozenset(range(N_LAYERS)))
    assert on_device - in_ram == routed_expert_weights(config) * 4  # float32


def test_the_shared_block_runs_geglu_experts_and_refuses_an_activation_it_does_not_know():
    """Gemma 4's settings of the shared block: softmax top k renormalised, GeGLU; the SwiGLU families' identity
    does not name the activation (theirs stays what it was)."""
    gemma = routed_config((4, 2, 32))
    gemma.check(N_LAYERS)
    assert gemma.describe()["activation"] == "gelu_tanh" and (gemma.routing, gemma.norm_topk_prob) == ("softmax_topk", True)
    assert "activation" not in MoeConfig(n_experts=4, top_k=2, expert_size=32, routing="softmax_topk",
                                         norm_topk_prob=True).describe()
    with pytest.raises(ValueError, match=r"expert activation 'relu': expected one of silu, gelu_tanh"):
        MoeConfig(n_experts=4, top_k=2, expert_size=32, routing="softmax_topk", norm_topk_prob=True,
                  activation="relu").check(N_LAYERS)


@needs_int4
def test_experts_in_host_ram_match_the_on_device_model_one_shot_chunked_and_decoding(files):
    folder = files[0]
    on_device, placed = _load(folder), _load(folder, frozenset(range(N_LAYERS)))
    block = placed.model.layers[0].experts.moe
    assert all(isinstance(w, int4.Int4Weight) for w in (*block.gate_up, *block.down))
    assert block.expert_device.type == "cpu" and isinstance(block.router, torch.Tensor)
    assert isinstance(on_device.model.layers[0].experts.moe.gate_up, torch.Tensor)
    arena = moe_placement.arena_bytes(placed.model.layers)
    assert arena == placed.model.expert_bytes == N_LAYERS * block.expert_bytes
    assert block.expert_bytes == routed_expert_weights(placed.config) * moe_placement.INT4_BYTES_PER_WEIGHT
    # The parked K/V's identity tells float experts from 4-bit ones.
    assert moe_placement.describe(placed.model.layers) == {"experts": [f"{i}:cpu:int4" for i in range(N_LAYERS)]}
    assert moe_placement.describe(on_device.model.layers)["experts"][0] == "0:cpu:float"

    ids = torch.tensor(placed.tokenizer.encode(TEXT))
    with torch.inference_mode():
        ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()(ids[None]).logits[0]
        exact = on_device.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(on_device), all_logits=True)[0]
        one_shot = placed.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(placed), all_logits=True)[0]
        kv, n = _kv(placed), len(ids) - 3
        chunked = [placed.model.forward_chunks([SeqChunk(1, a, ids[a : min(a + 16, n)])], kv, all_logits=True)[0]
                   for a in range(0, n, 16)]
        decoded = [placed.model.forward_chunks([SeqChunk(1, pos, ids[pos : pos + 1])], kv)[0]
                   for pos in range(n, len(ids))]
    assert (exact - ref).abs().max().item() <= 1e-4  # float experts on the device: transformers' logits
    _close(one_shot, exact, "one shot")
    _close(one_shot, ref, "one shot against transformers")
    _close(torch.cat(chunked), exact[:n], "chunked prefill")
    _close(torch.stack(decoded), exact[n:], "decode")


@needs_int4
def test_only_the_placed_layers_change(files):
    """`--moe-cpu-layers 2`: layers 0 and 1 hold 4-bit experts in RAM; the other layers' blocks are the float
    model's, bit for bit."""
    folder = files[0]
    on_device, split = _load(folder), _load(folder, frozenset({0, 1}))
    x = torch.randn(24, split.config.hidden_size, generator=torch.Generator().manual_seed(1))
    mlp_out = torch.randn(24, split.config.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        for i in range(2, N_LAYERS):
            assert torch.equal(split.model.layers[i].experts(x, mlp_out, 0, False),
                               on_device.model.layers[i].experts(x, mlp_out, 0, False)), f"layer {i} changed"
    assert moe_placement.describe(split.model.layers)["experts"][:3] == ["0:cpu:int4", "1:cpu:int4", "2:cpu:float"]


@pytest.mark.skipif(not kquant_weight.available(), reason="no native kernels here")
def test_from_the_gguf_the_experts_stay_the_files_blocks(files):
    """From the GGUF (one fused ffn_gate_up_exps stack, as llama.cpp's converter writes it): the experts in
    host RAM are the file's Q8_0 rows, and the logits stay within the 8-bit activations' rounding of the file's
    values run in float."""
    gguf_path = files[1]
    in_float, placed = _load(gguf_path), _load(gguf_path, frozenset(range(N_LAYERS)))
    block = placed.model.layers[3].experts.moe
    assert all(isinstance(w, Q8Weight) for w in (*block.gate_up, *block.down))
    assert moe_placement.describe(placed.model.layers)["experts"][3] == "3:cpu:q8"
    assert block.expert_bytes == 4 * (2 * 32 * 64 + 64 * 32) // 32 * 34  # 34 bytes for 32 weights, as in the file
    ids = torch.tensor(placed.tokenizer.encode(TEXT))
    with torch.inference_mode():
        want = in_float.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(in_float), all_logits=True)[0]
        got = placed.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(placed), all_logits=True)[0]
    assert (got - want).abs().max().item() <= 2e-2


@needs_int4
def test_from_a_gguf_with_q4_0_experts_the_groups_are_the_files_codes(tmp_path):
    """A fused ffn_gate_up_exps (and ffn_down_exps) in Q4_0: each expert's 4-bit groups are sliced from the file's
    codes (no float round trip), and the logits stay within int4's tolerance of the file's values run in float."""
    types = {name: "Q4_0" for name in Q8_EXPERTS}
    gguf_path = write_tiny_gguf(tmp_path, "gemma4", quantize=False, tensor_types=types, **EXPERTS)
    in_float, placed = _load(gguf_path), _load(gguf_path, frozenset(range(N_LAYERS)))
    block = placed.model.layers[2].experts.moe
    assert all(isinstance(w, int4.Int4Weight) for w in (*block.gate_up, *block.down))
    # Expert 1's weight is built from the file's codes, scales and minimums (its slice of the fused stack).
    t = next(x for x in GGUFReader(gguf_path).tensors if x.name == "blk.2.ffn_gate_up_exps.weight")
    _, rows, cols = (int(x) for x in reversed(t.shape))
    codes, scale, minimum = q4_groups(t.name, torch.from_numpy(np.array(t.data[1]).reshape(-1)), t.tensor_type,
                                      (rows, cols))
    assert torch.equal(dense(block.gate_up[1]), implied(block.gate_up[1], codes, scale, minimum))
    ids = torch.tensor(placed.tokenizer.encode(TEXT))
    with torch.inference_mode():
        ref = in_float.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(in_float), all_logits=True)[0]
        got = placed.model.forward_chunks([SeqChunk(0, 0, ids)], _kv(placed), all_logits=True)[0]
    _close(got, ref, "Q4_0 experts")


def _parity_base(model: str, storage: str) -> dict:
    return {"model": model, "devices": "cpu", "ctx_size": 1024, "cpu_weights": "float", "moe_experts": "cpu",
            "conversation_cache_storage": storage, "conversation_cache_min_free_mib": 0,
            "conversation_cache_block_tokens": 16}


@needs_int4
def test_a_parked_conversation_with_experts_in_host_ram_continues_as_if_it_never_left(files):
    outcome = run_scenario("basic", _parity_base(files[0], "ram"), n_words=40, max_tokens=8)
    assert outcome.passed, outcome.detail


@pytest.mark.skipif(not kquant_weight.available(), reason="no native kernels here")
def test_from_the_gguf_a_conversation_parked_in_tiered_storage_resumes_across_a_restart(files):
    """The GGUF's experts in host RAM (its Q8_0 blocks): a conversation one engine parked resumes in the next."""
    outcome = run_restart(_parity_base(files[1], "tiered"), {}, n_words=40, max_tokens=8)
    assert outcome.passed, outcome.detail
