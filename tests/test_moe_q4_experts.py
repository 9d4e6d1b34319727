"""Experts of a Q4_0 / Q4_1 / Q4_K GGUF placed in host RAM (`--moe-experts cpu`, `--moe-cpu-layers N`, or a CPU
model with `--cpu-weights int4`) become 4-bit groups from the file's own codes, scales and minimums, sliced per
expert, as a dense Q4 tensor does, instead of being dequantised and quantised again (Q4_K stacks stay in the
file's blocks where the native kernels run: tests/test_kquant_weights.py). Other types keep the float values
quantised (the groups the former path made)."""

from __future__ import annotations

import pytest
import torch

from engine.kv import KVBuffers, KVLayout
from engine.model import SeqChunk, int4, load_model, plan_stages
from engine.model.gguf_dequant import q4_groups
from engine.model.kquant_weight import Q4KWeight
from engine.model.loader import read_model_config
from engine.model.q8_weight import Q8Weight
from tests.int4_kernels import dense, implied, same
from tests.moe_fixtures import N_EXPERTS, write_tiny_moe_gguf

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not int4.available(), reason="this torch has no CPU int4 kernels")

QTYPES = ("Q4_0", "Q4_1", "Q4_K")
# Q4_K blocks span 256 values of a row: the experts' rows (hidden for gate/up, expert size for down) are 256 long.
SIZES = {"hidden_size": 256, "moe_intermediate_size": 256}
MOE_LAYERS = frozenset({0, 2})  # the tiny Qwen3-MoE's layer 1 has a dense MLP
TEXT = "The quick brown fox jumps over the lazy dog. def add(a, b): return a + b"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """One file per type with every expert stack in it, and one with Q4_K gate/up beside a Q8_0 down."""
    out = {q: write_tiny_moe_gguf(tmp_path_factory.mktemp(q), "qwen3_moe",
                                  expert_types=dict.fromkeys(("gate", "up", "down"), q), **SIZES) for q in QTYPES}
    out["mixed"] = write_tiny_moe_gguf(tmp_path_factory.mktemp("mixed"), "qwen3_moe",
                                       expert_types={"gate": "Q4_K", "up": "Q4_K", "down": "Q8_0"}, **SIZES)
    return out


def _load(path: str, *, cpu_experts: frozenset[int] = frozenset(), int4_weights: bool = False):
    stages = plan_stages(read_model_config(path).n_layers, "cpu", "")
    return load_model(path, stages, torch.float32, cpu_experts=cpu_experts, int4_weights=int4_weights)


def _tensor(path: str, name: str):
    return next(t for t in gguf.GGUFReader(path).tensors if t.name == name)


def _file_groups(path: str, name: str) -> list[int4.Groups]:
    """Each expert's (codes, scale, minimum), decoded from its own 2-D slice of the file's stack."""
    import numpy as np

    t = _tensor(path, name)
    _, rows, cols = (int(x) for x in reversed(t.shape))
    return [q4_groups(name, torch.from_numpy(np.array(t.data[j]).reshape(-1)), t.tensor_type, (rows, cols))
            for j in range(N_EXPERTS)]


def _reference(path: str, layer: int, parts: tuple[str, ...]) -> list[int4.Int4Weight]:
    """The layer's expert stacks `parts` ("gate", "up" or "down") fused by rows, as the dense path builds a Q4
    projection: Int4Weight.from_groups of the file's groups, one per expert."""
    stacks = [_file_groups(path, f"blk.{layer}.ffn_{part}_exps.weight") for part in parts]
    return [int4.Int4Weight.from_groups(*(torch.cat(x) for x in zip(*groups, strict=True)))
            for groups in zip(*stacks, strict=True)]





def _skip_file_blocks(qtype: str, kernel: str) -> None:
    if qtype == "Q4_K" and kernel == "blocks":
        pytest.skip("with the native kernels Q4_K experts stay in the file's blocks (tests/test_kquant_weights.py)")


def file_rows(path: str, layer: int, parts: tuple[str, ...], expert: int) -> torch.Tensor:
    """Expert `expert`'s rows of the layer's stacks `parts`, fused by rows, as the file's bytes."""
    import numpy as np

    rows = [np.array(_tensor(path, f"blk.{layer}.ffn_{part}_exps.weight").data[expert]) for part in parts]
    return torch.from_numpy(np.concatenate(rows))


def _logits(lm) -> torch.Tensor:
    c = lm.config
    kv = KVBuffers(KVLayout(c.n_layers, c.n_kv_heads, c.head_dim, lm.dtype), 1, 64, lm.model.stages)
    ids = torch.tensor(lm.tokenizer.encode(TEXT))
    return lm.model.forward_chunks([SeqChunk(0, 0, ids)], kv, all_logits=True)[0]


def _relative(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("qtype", QTYPES)
def test_q4_experts_in_host_ram_are_the_files_groups(files, qtype, kernel):
    _skip_file_blocks(qtype, kernel)
    path = files[qtype]
    direct = _load(path, cpu_experts=MOE_LAYERS)
    for i in MOE_LAYERS:
        moe = direct.model.layers[i].moe
        assert moe.expert_device.type == "cpu"
        gate_up, down = _reference(path, i, ("gate", "up")), _reference(path, i, ("down",))
        assert isinstance(moe.gate_up, list) and isinstance(moe.down, list)
        assert all(same(a, b) for a, b in zip(moe.gate_up, gate_up, strict=True))
        assert all(same(a, b) for a, b in zip(moe.down, down, strict=True))
    # The kernel's weights are the file's codes with its scales and minimums (rounded as the kernel keeps them), so
    # they are at least as close to gguf's own dequantisation of the file as re-quantising the dequantised floats.
    t = _tensor(path, "blk.2.ffn_down_exps.weight")
    assert t.tensor_type.name == qtype
    file_values = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
    codes, scale, minimum = _file_groups(path, t.name)[3]
    w = direct.model.layers[2].moe.down[3]
    ours = dense(w)
    assert torch.equal(ours, implied(w, codes, scale, minimum))
    requantised = dense(int4.Int4Weight(file_values[3]))
    assert (ours - file_values[3]).abs().max() <= (requantised - file_values[3]).abs().max()


@pytest.mark.parametrize("qtype", QTYPES)
def test_q4_experts_give_the_logits_of_the_dense_reuse_path(files, qtype, kernel):
    """The model's logits are bitwise those of the float-loaded model whose experts are then built from the
    file's groups as a dense Q4 projection is, and at least as close to the float logits as the former path
    (dequantise, then quantise_experts)."""
    _skip_file_blocks(qtype, kernel)
    path = files[qtype]
    direct = _load(path, cpu_experts=MOE_LAYERS)
    floats = _load(path)
    assert direct.fingerprint == floats.fingerprint  # the same file, read the same way
    ref, ours = _logits(floats), _logits(direct)
    for i in MOE_LAYERS:  # the former path: the dequantised experts quantised again
        floats.model.layers[i].moe.quantize_experts(shared=False)
    former = _logits(floats)
    for i in MOE_LAYERS:  # the dense path's way: Int4Weight.from_groups of the file's codes
        moe = floats.model.layers[i].moe
        gate_up, down = _reference(path, i, ("gate", "up")), _reference(path, i, ("down",))
        object.__setattr__(moe, "gate_up", gate_up)
        object.__setattr__(moe, "down", down)
    assert torch.equal(ours, _logits(floats))
    relative, former_relative = _relative(ours, ref), _relative(former, ref)
    assert relative < 0.1 and relative <= former_relative + 1e-6, (relative, former_relative)


def test_other_expert_types_are_quantised_from_their_values_beside_q4_ones(files):
    """Q4_K gate/up with a Q8_0 down: with PyTorch's kernel gate/up are the file's groups and down the groups
    quantize_experts makes of its values; with the native kernels both stay the file's rows (Q4_K, Q8_0); the
    CPU model with --cpu-weights int4 likewise."""
    path = files["mixed"]
    floats = _load(path)
    for load in (lambda: _load(path, cpu_experts=frozenset({2})), lambda: _load(path, int4_weights=True)):
        lm = load()
        assert lm.fingerprint == floats.fingerprint
        moe, float_moe = lm.model.layers[2].moe, floats.model.layers[2].moe
        if isinstance(moe.gate_up[0], Q4KWeight):  # the native kernels multiply the file's Q4_K rows as they are
            assert all(torch.equal(w.blocks, file_rows(path, 2, ("gate", "up"), j)) for j, w in enumerate(moe.gate_up))
        else:
            gate_up = _reference(path, 2, ("gate", "up"))
            assert all(same(a, b) for a, b in zip(moe.gate_up, gate_up, strict=True))
        if isinstance(moe.down[0], Q8Weight):  # the native kernels multiply the file's Q8_0 rows as they are
            assert all(torch.equal(w.blocks, file_rows(path, 2, ("down",), j)) for j, w in enumerate(moe.down))
        else:
            assert all(same(a, int4.Int4Weight(float_moe.down[j])) for j, a in enumerate(moe.down))


@pytest.mark.parametrize("qtype", QTYPES)
def test_quantised_experts_in_host_ram_serve_a_bfloat16_model(files, qtype):
    """The GPU case on the CPU: a model in bfloat16 (a CUDA model's dtype) with its 4-bit experts in host RAM.
    The experts compute in float32 and their sum comes back in the layer's dtype; it used to stop the start
    ("index_add_(): self (BFloat16) and source (Float) must have the same scalar type")."""
    path = files[qtype]
    stages = plan_stages(read_model_config(path).n_layers, "cpu", "")
    half = load_model(path, stages, torch.bfloat16, cpu_experts=MOE_LAYERS)
    assert {half.model.layers[i].moe.expert_dtype for i in MOE_LAYERS} == {torch.float32}
    logits = _logits(half)
    assert torch.isfinite(logits).all()
    full = _logits(_load(path, cpu_experts=MOE_LAYERS))
    # bfloat16 alone moves this tiny random model's logits ~20 %: the experts in host RAM add nothing to that.
    rounding = _relative(_logits(load_model(path, stages, torch.bfloat16)).float(), _logits(_load(path)))
    assert _relative(logits.float(), full) <= 1.2 * rounding, "bfloat16 rounding only"
