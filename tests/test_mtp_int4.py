"""A next-token (MTP) layer whose experts are held as the main model's CPU experts are with int4 weights (the
file's K-quant blocks or 4-bit groups, the rest float32), against the same layer in float32; what the size guard
counts for it."""

from __future__ import annotations

import pytest
import torch

from engine.model import int4

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not int4.available(), reason="this torch has no CPU int4 kernels")

# What the other MoE tests allow 4-bit experts (tests/test_moe_models.py): the block's output within 3 % (relative)
# of float32's; on weights on the 4-bit grid only the kernels' rounded activations differ.
RELATIVE = 0.03


def _relative(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).norm() / ref.norm()).item()


def _load(path: str):
    from engine.model import load_model, plan_stages
    from engine.model.loader import read_model_config

    return load_model(path, plan_stages(read_model_config(path).n_layers, "cpu", ""), torch.float32)


def _on_grid(layer, only: str = ""):
    """The kept layer with every matrix (whose key starts with `only`) on a 4-bit grid per group of 32 (float32, as
    a Q4_1 file's values)."""
    from engine.model.mtp import KeptTensor
    from engine.model.mtp_experts import float_weight
    from tests.model_fixtures import on_int4_grid

    return {key: KeptTensor(t.name, "torch.float32", t.shape, on_int4_grid(float_weight(t)))
            if len(t.shape) >= 2 and t.shape[-1] % 32 == 0 and key.startswith(only) else t
            for key, t in layer.items()}


def _compare(lm, layer, ref_layer=None) -> tuple:
    """The float32 block of `ref_layer` (`layer` unless given) and the 4-bit-experts block of `layer`, and their MoE
    outputs and output rows apart (relative)."""
    from engine.model.mtp_layer import MtpBlock

    ref, got = MtpBlock(lm.model, ref_layer or layer), MtpBlock(lm.model, layer, int4_experts=True)
    torch.manual_seed(2)
    x = torch.randn(16, lm.config.hidden_size)
    next_ids, hidden = torch.randint(0, lm.config.vocab_size, (12,)), torch.randn(12, lm.config.hidden_size)
    assert ref.moe is not None and got.moe is not None
    moe = _relative(got.moe(x, 0), ref.moe(x, 0))
    (_, ref_out), (_, got_out) = (b.forward(next_ids, hidden, 0, b.new_cache(16)) for b in (ref, got))
    return ref, got, moe, _relative(got_out, ref_out)


def _values(groups) -> torch.Tensor:
    """What 4-bit groups (codes, scale, minimum) hold, as float32 [..., rows, cols]."""
    codes, scale, minimum = groups
    return (codes.float().view(*codes.shape[:-1], -1, 32) * scale[..., None] + minimum[..., None]).view(codes.shape)


def test_experts_from_a_folder_are_4_bit_groups_and_track_the_float_layer(tmp_path):
    """HF experts (one tensor each) quantised one at a time: on the 4-bit grid their groups give the values back,
    and the layer computes as the float32 one within the 4-bit tolerance."""
    from engine.model import mtp_experts
    from tests.moe_fixtures import write_tiny_moe_model

    lm = _load(write_tiny_moe_model(tmp_path, "glm4_moe", seed=3))
    layer = _on_grid(lm.model.mtp[0])
    n = lm.config.n_layers
    values = _values(mtp_experts.groups(layer, f"{n}.", "here")(f"{n}.experts.down"))
    stack = torch.stack([layer[f"expert.{j}.down"].data for j in range(lm.config.moe.n_experts)])
    assert (values - stack).abs().max().item() <= 1e-6
    ref, got, moe, out = _compare(lm, layer)
    assert isinstance(ref.moe.gate_up, torch.Tensor) and ref.moe.gate_up.dtype == torch.float32
    assert isinstance(got.moe.gate_up[0], int4.Int4Weight) and isinstance(got.moe.down[0], int4.Int4Weight)
    assert isinstance(got.moe.shared_gate_up, int4.Int4Weight) and got.moe.router.dtype == torch.float32
    assert moe < RELATIVE and out < RELATIVE, (moe, out)


def test_experts_from_a_gguf_stay_in_the_file_s_blocks_and_groups(tmp_path):
    """A GGUF's Q4_K down stack stays in its blocks (with the native kernels), its Q4_0 gate stack gives its own
    4-bit groups and its Q5_0 up stack is quantised one expert at a time (each expert's run of blocks decoded
    alone: the groups of the whole stack's values). The layer computes as the float32 one holding those values
    (the file's, the up stack's 4-bit groups', the fixture's float32 shared expert put on the grid) within the
    tolerance."""
    import math

    from engine.model import kquant_weight, mtp_experts
    from engine.model.mtp import KeptTensor
    from tests.moe_fixtures import write_tiny_moe_gguf

    path = write_tiny_moe_gguf(tmp_path, "glm4_moe", expert_types={"gate": "Q4_0", "up": "Q5_0", "down": "Q4_K"},
                               hidden_size=256, moe_intermediate_size=256)
    lm = _load(path)
    layer, n = _on_grid(lm.model.mtp[0], "shared."), lm.config.n_layers
    up = layer["experts.up"]
    groups = mtp_experts.groups(layer, f"{n}.", "here")(f"{n}.experts.up")
    whole = int4.quantize_groups(mtp_experts.float_weight(up).view(-1, up.shape[-1]))
    assert all(torch.equal(a.view(b.shape), b) for a, b in zip(groups, whole, strict=True))
    ref_layer = {**layer, "experts.up": KeptTensor(up.name, "torch.float32", up.shape, _values(groups))}
    _, got, moe, out = _compare(lm, layer, ref_layer)
    kind = kquant_weight.Q4KWeight if kquant_weight.available() else int4.Int4Weight
    assert isinstance(got.moe.gate_up[0], int4.Int4Weight) and isinstance(got.moe.down[0], kind)
    assert moe < RELATIVE and out < RELATIVE, (moe, out)
    down = layer["experts.down"]  # the guard counts a stack kept in its blocks at the file's bytes
    assert mtp_experts.held_bytes({"experts.down": down}, True) == (
        down.data.numel() if kquant_weight.available() else math.prod(down.shape) * (20 + 40) // 32)


def test_the_guard_counts_the_bytes_the_experts_take_in_4_bit(tmp_path):
    """float32 for every tensor; with 4-bit experts their matrices at 20 bytes per 32 values (codes, scale and
    minimum) once built, and the largest build phase on top (a byte per code, a float scale and minimum per group:
    40 bytes per 32 values; gate and up together, twice, as they are joined by rows; or down alone); the decline
    names how the layer is held."""
    import re

    from engine.model.mtp_experts import held_bytes
    from engine.runtime.mtp_drafts import declines
    from tests.moe_fixtures import write_tiny_moe_model

    lm = _load(write_tiny_moe_model(tmp_path, "glm4_moe", seed=3))
    (kept,) = lm.model.mtp

    def count(pattern: str) -> int:
        return sum(t.data.numel() for key, t in kept.items() if re.fullmatch(pattern, key))

    routed, routed_gate_up, shared = count(r"expert\.\d+\.(gate|up|down)"), count(r"expert\.\d+\.(gate|up)"), count(
        r"shared\.(gate|up|down)")
    rest = sum(t.data.numel() for t in kept.values()) - routed - shared
    assert routed and routed_gate_up and shared and rest
    assert held_bytes(kept, False) == 4 * (routed + shared + rest)
    need = held_bytes(kept, True)
    routed_down = routed - routed_gate_up
    assert need == (routed + shared) * 20 // 32 + max(2 * routed_gate_up, routed_down) * 40 // 32 + 4 * rest
    assert declines(lm.model, available=2 * need + 1, int4_experts=True) == ""
    why = declines(lm.model, available=need, int4_experts=True)
    assert why.startswith(f"its next-token layer needs {need / 2**30:.1f} GiB with its experts in 4-bit, more than")


def test_spec_mtp_with_4_bit_experts_answers_token_identical(tmp_path, caplog):
    """--cpu-weights int4 on a latent-attention model (its decode step runs the eager path that hands over the
    hidden rows): the layer drafts with its experts in 4-bit, and the answers are the target's own."""
    import logging

    from engine.config import EngineConfig
    from engine.runtime.engine import Engine
    from engine.runtime.requests import GenerationRequest, SamplingParams
    from tests.mla_fixtures import write_tiny_mla_model

    folder = write_tiny_mla_model(tmp_path, "deepseek_v3", seed=3, mtp=True)

    def answers(spec: str) -> tuple[list[list[int]], int]:
        engine = Engine.from_config(EngineConfig(model=folder, ctx_size=256, cpu_weights="int4", spec=spec))
        try:
            out = [[e.token_id for e in engine.submit(GenerationRequest(
                        f"{spec}-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=16))) if e.token_id is not None]
                   for i, prompt in enumerate([list(range(5, 40)), [7, 8, 9] * 10])]
            return out, engine.call(lambda: engine.stats.counters["spec_drafted_tokens"]).result()
        finally:
            engine.close()

    with caplog.at_level(logging.INFO, logger="strata.engine"):
        off, _ = answers("off")
        on, drafted = answers("mtp")
    assert "drafting with the model's next-token layer (on the CPU, its experts in 4-bit)" in caplog.text
    assert on == off and drafted > 0
