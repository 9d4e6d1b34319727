"""GGUF block decoding in torch: bit-identical to gguf-py's reference dequantiser for every accepted type."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as reference_dequantize
from gguf.quants import quantize as reference_quantize

from engine.errors import ModelLoadError
from engine.model import gguf_dequant
from engine.model.gguf_dequant import SUPPORTED, dequantize, q4_groups
from tests.model_fixtures import F16_FIELDS, random_blocks

T = GGMLQuantizationType
PLAIN = {T.F32: np.float32, T.F16: np.float16, T.BF16: None}
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def random_tensor(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random raw bytes of a [rows, cols] tensor: every bit random except finite float16 scale fields."""
    if qtype not in PLAIN:
        return random_blocks(qtype, rows, cols, seed)
    values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 3
    if qtype == T.BF16:
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(rows, -1)
    return values.astype(PLAIN[qtype]).view(np.uint8).reshape(rows, -1)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _ours(name: str, raw: np.ndarray, qtype, shape, device: str) -> torch.Tensor:
    return dequantize(name, torch.from_numpy(raw.reshape(-1).copy()).to(device), qtype, shape).cpu()


def test_every_listed_type_is_covered():
    assert {T[name] for name in F16_FIELDS} | set(PLAIN) == set(SUPPORTED)
    wanted = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
              "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4"}
    assert wanted <= {t.name for t in SUPPORTED}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", sorted(SUPPORTED, key=lambda t: t.value), ids=lambda t: t.name)
def test_random_blocks_decode_bit_identical_to_gguf(qtype, device):
    rows, cols = 24, 512
    raw = random_tensor(qtype, rows, cols, seed=qtype.value)
    with np.errstate(over="ignore"):  # random MXFP4 exponents reach float32's top: inf, as ours must give too
        ref = torch.from_numpy(np.ascontiguousarray(reference_dequantize(raw, qtype), dtype=np.float32))
    ours = _ours("blk.0.ffn_up.weight", raw, qtype, (rows, cols), device)
    assert ours.dtype == torch.float32 and ours.shape == (rows, cols)
    assert torch.equal(_bits(ours), _bits(ref)), f"{qtype.name}: {(ours != ref).sum().item()} values differ"


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.BF16, T.MXFP4], ids=lambda t: t.name)
def test_quantised_weights_decode_bit_identical_to_gguf(qtype):
    w = np.random.default_rng(1).standard_normal((32, 256)).astype(np.float32) * 0.05
    raw = reference_quantize(w, qtype)
    ref = torch.from_numpy(np.ascontiguousarray(reference_dequantize(raw, qtype)))
    ours = _ours("w", raw, qtype, w.shape, "cpu")
    assert torch.equal(_bits(ours), _bits(ref))
    assert (ours - torch.from_numpy(w)).abs().max() < 0.05  # and it is the weight, roughly


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.IQ4_XS], ids=lambda t: t.name)
def test_decoding_in_slices_gives_the_same_values(qtype, monkeypatch):
    raw = random_tensor(qtype, 9, 768, seed=3)
    whole = _ours("w", raw, qtype, (9, 768), "cpu")
    flat = torch.from_numpy(raw.reshape(-1).copy())
    groups = q4_groups("w", flat, qtype, (9, 768)) if qtype == T.Q4_K else ()
    monkeypatch.setattr(gguf_dequant, "_SLICE_VALUES", 700)  # 27 blocks in slices of 2, the last one short
    assert torch.equal(_bits(_ours("w", raw, qtype, (9, 768), "cpu")), _bits(whole))
    if groups:
        assert all(torch.equal(a, b) for a, b in zip(q4_groups("w", flat, qtype, (9, 768)), groups, strict=True))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q4_K], ids=lambda t: t.name)
def test_q4_groups_give_the_reference_values(qtype, device):
    rows, cols = 16, 512
    raw = random_tensor(qtype, rows, cols, seed=5)
    codes, scale, minimum = q4_groups("w", torch.from_numpy(raw.reshape(-1).copy()).to(device), qtype, (rows, cols))
    assert codes.dtype == torch.uint8 and codes.shape == (rows, cols) and int(codes.max()) <= 15
    assert scale.shape == minimum.shape == (rows, cols // 32)
    values = (codes.view(rows, -1, 32).float() * scale.unsqueeze(-1) + minimum.unsqueeze(-1)).view(rows, cols)
    ref = torch.from_numpy(np.ascontiguousarray(reference_dequantize(raw, qtype)))
    assert torch.equal(values.cpu(), ref)  # equal values (Q4_0's d * (q - 8) may give -0.0 where this gives 0.0)


def test_other_dtypes_are_produced_directly():
    raw = random_tensor(T.Q6_K, 4, 256)
    as_float = _ours("w", raw, T.Q6_K, (4, 256), "cpu")
    as_bf16 = dequantize("w", torch.from_numpy(raw.reshape(-1).copy()), T.Q6_K, (4, 256), torch.bfloat16)
    assert as_bf16.dtype == torch.bfloat16 and torch.equal(as_bf16, as_float.to(torch.bfloat16))


# ---------------------------------------------------------------- refusals name the tensor


def test_unsupported_type_is_refused_by_name():
    raw = torch.zeros(66 * 4, dtype=torch.uint8)
    with pytest.raises(ModelLoadError, match=r"tensor blk\.3\.attn_q\.weight: quantisation IQ2_XXS is not supported"):
        dequantize("blk.3.attn_q.weight", raw, T.IQ2_XXS, (4, 256))
    with pytest.raises(ModelLoadError, match=r"tensor x: quantisation unknown type 999 is not supported; expected"):
        dequantize("x", raw, 999, (4, 256))


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q8_0, T.F16], ids=lambda t: t.name)
def test_truncated_or_oversized_bytes_are_refused_by_name(qtype):
    raw = torch.from_numpy(random_tensor(qtype, 4, 512).reshape(-1).copy())
    for wrong in (raw[:-1], raw[: raw.numel() // 2], torch.cat((raw, raw[:8]))):
        with pytest.raises(ModelLoadError, match=rf"tensor token_embd\.weight: {qtype.name} of shape \(4, 512\) needs "
                                                 rf"{raw.numel()} bytes, got {wrong.numel()}"):
            dequantize("token_embd.weight", wrong, qtype, (4, 512))


def test_shape_that_splits_into_no_whole_blocks_is_refused():
    with pytest.raises(ModelLoadError, match=r"tensor w: shape \(4, 100\) does not split into Q4_K blocks of 256"):
        dequantize("w", torch.zeros(1000, dtype=torch.uint8), T.Q4_K, (4, 100))
