"""GGUF tensor blocks -> float tensors, decoded by vectorised torch code on the tensor's device (CPU or CUDA).

Every block format is decoded with the operations, and in the order, of gguf-py's reference dequantiser
(`gguf.quants.dequantize`), so the results are bit-identical to it (tests/test_gguf_dequant.py checks every
type). The block geometry (values per block, bytes per block) comes from gguf's own table. A tensor is decoded
in slices of whole blocks so that the temporaries stay small next to the output, whatever the tensor's size.

`q4_groups` returns the 4-bit codes of a Q4_0 / Q4_1 / Q4_K tensor with one scale and one minimum per 32
values (value = scale * code + minimum): the int4 CPU weights take them as they are, without a float copy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.errors import ModelLoadError

T = GGMLQuantizationType
QK_K = 256
# Slices of about this many values: their temporaries (a few float32 copies, ~4 MB each) stay small next to a
# model's weights, and the slices big enough that torch's per-operation cost does not count (measured: slices
# of 16K values load a 1B model in twice the time); a GPU wants bigger launches still.
_SLICE_VALUES = 1 << 20
_SLICE_VALUES_GPU = 1 << 24
# The 16 values of IQ4_NL / IQ4_XS codes (llama.cpp's kvalues_iq4nl).
_IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# The 16 e2m1 values of MXFP4 codes, doubled (llama.cpp's kvalues_mxfp4): 0 and 8 are +0 and -0.
_MXFP4_VALUES = (0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 0.0, -1.0, -2.0, -3.0, -4.0, -6.0, -8.0, -12.0)


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The little-endian float16 at byte `at` of each block, as float32 [n, 1]."""
    return blocks[:, at : at + 2].contiguous().view(torch.float16).float()


def _shifts(values: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8, device=like.device)


def _split_nibbles(qs: torch.Tensor, width: int) -> torch.Tensor:
    """[n, m] bytes -> [n, m // width, 2, width]: per run of `width` bytes, the low nibbles then the high ones."""
    runs = qs.reshape(qs.shape[0], -1, 1, width)
    return (runs >> _shifts((0, 4), qs).view(1, 1, 2, 1)) & 0x0F


def _bits(masks: torch.Tensor, width: int, n_bits: int, bits_each: int) -> torch.Tensor:
    """[n, m] bytes -> [n, m // width, 8 // bits_each, width]: field j of every byte of each run."""
    shifts = _shifts(tuple(range(0, n_bits, bits_each)), masks).view(1, 1, -1, 1)
    return (masks.reshape(masks.shape[0], -1, 1, width) >> shifts) & ((1 << bits_each) - 1)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    q = _split_nibbles(b[:, 2:], 16).reshape(b.shape[0], 32).float() - 8
    return d * q


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b, 0), _f16(b, 2)
    q = _split_nibbles(b[:, 4:], 16).reshape(b.shape[0], 32).float()
    return d * q + m


def _q5_high(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1: bit i of the little-endian 32-bit field is the fifth bit of value i."""
    return _bits(qh, 4, 8, 1).transpose(2, 3).reshape(qh.shape[0], 32)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    low = _split_nibbles(b[:, 6:], 16).reshape(b.shape[0], 32)
    q = (low | (_q5_high(b[:, 2:6]) << 4)).float() - 16
    return d * q


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b, 0), _f16(b, 2)
    low = _split_nibbles(b[:, 8:], 16).reshape(b.shape[0], 32)
    q = (low | (_q5_high(b[:, 4:8]) << 4)).float()
    return d * q + m


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b, 0)


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales = b[:, :16]
    d, dmin = _f16(b, 80), _f16(b, 82)
    dl = (d * (scales & 0x0F).float()).view(n, 16, 1)
    ml = (dmin * (scales >> 4).float()).view(n, 16, 1)
    q = _bits(b[:, 16:80], 32, 8, 2).reshape(n, 16, 16).float()
    return (dl * q - ml).view(n, QK_K)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    hmask, qs, packed = b[:, :32], b[:, 32:96], b[:, 96:108]
    d = _f16(b, 108)
    # 16 six-bit scales: low 4 bits from the nibbles of bytes 0-7, high 2 bits from the bit pairs of bytes 8-11.
    low = _split_nibbles(packed[:, :8], 8).reshape(n, 16)
    high = _bits(packed[:, 8:], 4, 8, 2).reshape(n, 16)
    scales = (low | (high << 4)).float() - 32
    dl = (d * scales).view(n, 16, 1)
    ql = _bits(qs, 32, 8, 2).reshape(n, 16, 16)
    # A clear mask bit subtracts 4 (llama.cpp stores the high bit inverted).
    hm = (_bits(hmask, 32, 8, 1).reshape(n, 16, 16) ^ 1) << 2
    q = ql.float() - hm.float()
    return (dl * q).view(n, QK_K)


def _k_scale_min(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: eight 6-bit scales and eight 6-bit minimums packed in 12 bytes, as uint8 [n, 8] each."""
    d, m, md = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scale = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    minimum = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return scale, minimum


def _q4_k_parts(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K as (codes uint8 [n, 8, 32], d * scale [n, 8, 1], dmin * minimum [n, 8, 1])."""
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scale_min(b[:, 4:16])
    dl = (d * sc.float()).view(n, 8, 1)
    ml = (dmin * mn.float()).view(n, 8, 1)
    return _split_nibbles(b[:, 16:], 32).reshape(n, 8, 32), dl, ml


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    q, dl, ml = _q4_k_parts(b)
    return (dl * q.float() - ml).view(b.shape[0], QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scale_min(b[:, 4:16])
    dl = (d * sc.float()).view(n, 8, 1)
    ml = (dmin * mn.float()).view(n, 8, 1)
    low = _split_nibbles(b[:, 48:], 32).reshape(n, 8, 32)
    high = _bits(b[:, 16:48], 32, 8, 1).reshape(n, 8, 32)
    q = (low | (high << 4)).float()
    return (dl * q - ml).view(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(b, 208) * scales).view(n, 16, 1)
    low = _split_nibbles(b[:, :128], 64).reshape(n, 8, 32)
    high = _bits(b[:, 128:192], 32, 8, 2).reshape(n, 8, 32)
    q = ((low | (high << 4)).float() - 32).view(n, 16, 16)
    return (d * q).view(n, QK_K)


def _iq4_table(like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(_IQ4_VALUES, dtype=torch.float32, device=like.device)


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    codes = _split_nibbles(b[:, 2:], 16).reshape(b.shape[0], 32)
    return _f16(b, 0) * _iq4_table(b)[codes.long()]


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b, 0)
    high_field = b[:, 2].int() | (b[:, 3].int() << 8)  # little-endian uint16: 2 high bits of each of 8 scales
    high = (high_field.view(n, 1) >> torch.arange(0, 16, 2, device=b.device, dtype=torch.int32)) & 0x03
    low = ((b[:, 4:8].reshape(n, 4, 1) >> _shifts((0, 4), b).view(1, 1, 2)) & 0x0F).reshape(n, 8)
    scales = (low.int() | (high << 4)).float() - 32
    dl = (d * scales).view(n, 8, 1)
    codes = _split_nibbles(b[:, 8:], 16).reshape(n, 8, 32)
    return (dl * _iq4_table(b)[codes.long()]).view(n, QK_K)


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    """MXFP4 (gpt-oss's experts): an e8m0 exponent byte, then 32 e2m1 codes as nibbles (low nibbles the first 16
    values); a value is kvalues[code] (e2m1 doubled, llama.cpp's kvalues_mxfp4) * 2^(exponent - 128), which is
    e2m1 * 2^(exponent - 127): exact in float32 for every exponent (2^-128 is a float32 subnormal)."""
    scale = torch.ldexp(torch.ones(b.shape[0], 1, device=b.device), b[:, :1].int() - 128)
    codes = _split_nibbles(b[:, 1:], 16).reshape(b.shape[0], 32)
    return scale * torch.tensor(_MXFP4_VALUES, dtype=torch.float32, device=b.device)[codes.long()]


_BLOCK_DECODERS: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.Q8_0: _q8_0,
    T.Q2_K: _q2_k, T.Q3_K: _q3_k, T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k,
    T.IQ4_NL: _iq4_nl, T.IQ4_XS: _iq4_xs, T.MXFP4: _mxfp4,
}
_PLAIN: dict[int, torch.dtype] = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}
# The tables are keyed by int (a raw type read from a file looks them up) but their keys are all members.
SUPPORTED = cast(frozenset[GGMLQuantizationType], frozenset(_PLAIN) | frozenset(_BLOCK_DECODERS))
Q4_GROUPED = frozenset({T.Q4_0, T.Q4_1, T.Q4_K})
# Block types of more than 4 bits a weight: with 4-bit CPU weights such projections become 8-bit rows instead of
# 4-bit groups (engine/model/q8_weight.py).
WIDE = frozenset({T.Q5_0, T.Q5_1, T.Q5_K, T.Q6_K, T.Q8_0, T.Q8_1, T.Q8_K})


def type_name(qtype: int) -> str:
    """The GGML name of a quantisation type id (Q4_K, ...), also for ids gguf does not know."""
    try:
        return GGMLQuantizationType(qtype).name
    except ValueError:
        return f"unknown type {int(qtype)}"


def tensor_bytes(name: str, qtype: int, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of `qtype` and `shape` (outermost first) occupies; ModelLoadError naming the tensor
    when the type is not one this module decodes or the shape does not split into whole blocks."""
    if qtype not in SUPPORTED:
        names = ", ".join(sorted(t.name for t in SUPPORTED))
        raise ModelLoadError(
            f"tensor {name}: quantisation {type_name(qtype)} is not supported; expected one of {names}"
        )
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    if not shape or any(s <= 0 for s in shape) or shape[-1] % block:
        raise ModelLoadError(
            f"tensor {name}: shape {shape} does not split into {type_name(qtype)} blocks of {block} values"
        )
    count = 1
    for s in shape:
        count *= s
    return count // block * size


def _checked_blocks(name: str, raw: torch.Tensor, qtype: int, shape: tuple[int, ...]) -> torch.Tensor:
    expected = tensor_bytes(name, qtype, shape)
    if raw.dtype != torch.uint8 or raw.dim() != 1:
        raise ModelLoadError(f"tensor {name}: expected its raw bytes as a 1-D uint8 tensor, got {raw.dtype} {tuple(raw.shape)}")
    if raw.numel() != expected:
        raise ModelLoadError(
            f"tensor {name}: {type_name(qtype)} of shape {shape} needs {expected} bytes, got {raw.numel()} "
            "(the file is truncated or corrupt)"
        )
    _, size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    return raw.view(-1, size)


def dequantize(
    name: str, raw: torch.Tensor, qtype: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Decode the raw bytes of tensor `name` (1-D uint8, on the device to decode on) into `dtype` of `shape`.

    ModelLoadError naming the tensor when its type is not supported or its byte count does not match.
    """
    blocks = _checked_blocks(name, raw, qtype, shape)
    if qtype in _PLAIN:
        return raw.view(_PLAIN[qtype]).view(shape).to(dtype)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    decode = _BLOCK_DECODERS[qtype]
    out = torch.empty(blocks.shape[0], block, dtype=dtype, device=raw.device)
    step = max(1, (_SLICE_VALUES if raw.device.type == "cpu" else _SLICE_VALUES_GPU) // block)
    for a in range(0, blocks.shape[0], step):
        out[a : a + step] = decode(blocks[a : a + step])
    return out.view(shape)


def is_blocked(qtype: int) -> bool:
    """Whether `qtype` is a block format (decoded block by block), not a plain float type."""
    return qtype in _BLOCK_DECODERS


def row_blocks(name: str, raw: torch.Tensor, qtype: int, shape: tuple[int, int]) -> torch.Tensor:
    """The raw bytes of a 2-D block-format tensor as uint8 [rows, bytes per row] (each row whole blocks);
    ModelLoadError naming the tensor as `dequantize` gives it."""
    assert is_blocked(qtype) and len(shape) == 2, (type_name(qtype), shape)
    return _checked_blocks(name, raw, qtype, shape).view(shape[0], -1)


def decode_rows(rows: torch.Tensor, qtype: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows of `row_blocks` (uint8 [n, bytes per row]) decoded to [n, values per row] in `dtype`: the values
    `dequantize` gives those rows of the whole tensor, bit for bit (every decoder works block by block)."""
    _, size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    n = rows.shape[0]
    return _BLOCK_DECODERS[qtype](rows.reshape(-1, size)).view(n, -1).to(dtype)


def q4_groups(name: str, raw: torch.Tensor, qtype: int, shape: tuple[int, ...]):
    """A Q4_0 / Q4_1 / Q4_K tensor of `shape` [..., rows, cols] (a matrix, or a stack of them such as an expert
    tensor [experts, rows, cols]) as (codes uint8 [..., rows, cols] in 0..15, scale, minimum float32
    [..., rows, cols // 32]) with value = scale * code + minimum for each group of 32 values along a row."""
    assert qtype in Q4_GROUPED and len(shape) >= 2, (type_name(qtype), shape)
    blocks = _checked_blocks(name, raw, qtype, shape)
    cols = shape[-1]
    block, _ = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    per_block = block // 32  # groups of 32 in one block
    codes = torch.empty(blocks.shape[0] * per_block, 32, dtype=torch.uint8, device=raw.device)
    scale = torch.empty(blocks.shape[0] * per_block, dtype=torch.float32, device=raw.device)
    minimum = torch.empty_like(scale)
    step = max(1, (_SLICE_VALUES if raw.device.type == "cpu" else _SLICE_VALUES_GPU) // block)
    for a in range(0, blocks.shape[0], step):
        b = blocks[a : a + step]
        at = slice(a * per_block, (a + b.shape[0]) * per_block)
        if qtype == T.Q4_K:
            q, dl, ml = _q4_k_parts(b)
            codes[at], scale[at], minimum[at] = q.reshape(-1, 32), dl.reshape(-1), -ml.reshape(-1)
        else:
            d = _f16(b, 0)
            codes[at] = _split_nibbles(b[:, 4 if qtype == T.Q4_1 else 2 :], 16).reshape(-1, 32)
            scale[at] = d.reshape(-1)
            minimum[at] = (_f16(b, 2) if qtype == T.Q4_1 else -8 * d).reshape(-1)
    return codes.view(shape), scale.view(*shape[:-1], cols // 32), minimum.view(*shape[:-1], cols // 32)
