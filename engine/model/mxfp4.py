"""MXFP4 expert stacks as a released gpt-oss checkpoint holds them (`mlp.experts.*_blocks` / `*_scales`).

A block is 32 e2m1 values and one e8m0 exponent, as in a GGUF's MXFP4 (gguf_dequant._mxfp4), laid out otherwise:
`*_blocks` uint8 [experts, rows, blocks, 16] with byte j holding value 2j in its low nibble and 2j + 1 in its high
one, `*_scales` uint8 [experts, rows, blocks] (value = e2m1 * 2^(scale - 127)); the rows are the projection's
outputs, gate_up's gate and up interleaved (even, odd), as transformers' own float layout has them. The codes are
the same 4-bit indices as GGUF's (its table is e2m1 doubled, its exponent one lower), so a block becomes the GGUF's
17 bytes by moving nibbles only, as llama.cpp's converter does: the experts can then stay in these bytes
(kquant_weight.MXFP4Weight) or be decoded to float, both exactly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.model import kquant_weight

# e2m1's 16 values by code (the OCP microscaling spec; code 8 is -0).
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _check(blocks: torch.Tensor, scales: torch.Tensor, name: str) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() != 4 or blocks.shape[-1] != 16 \
            or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"{name}: MXFP4 blocks uint8 [experts, rows, blocks, 16] with scales uint8 [experts, rows, "
                         f"blocks] expected, got {blocks.dtype} {tuple(blocks.shape)} and {scales.dtype} "
                         f"{tuple(scales.shape)}")


def _codes(blocks: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32] codes in value order."""
    return torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)


def decode(blocks: torch.Tensor, scales: torch.Tensor, name: str = "experts") -> torch.Tensor:
    """float32 [experts, rows, blocks * 32]: the checkpoint's values."""
    _check(blocks, scales, name)
    values = torch.tensor(_E2M1)[_codes(blocks).long()]
    return (values * torch.ldexp(torch.ones(scales.shape), scales.int() - 127).unsqueeze(-1)).flatten(-2)


def gguf_rows(blocks: torch.Tensor, scales: torch.Tensor, name: str = "experts") -> torch.Tensor:
    """uint8 [experts, rows, blocks * 17]: the same blocks as a GGUF's MXFP4 rows (exponent byte, then byte j
    holding value j in its low nibble and value j + 16 in its high one), what decode() gives decoded."""
    _check(blocks, scales, name)
    codes = _codes(blocks)
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    return torch.cat((scales.unsqueeze(-1), packed), dim=-1).flatten(-2).contiguous()


def split_gate_up(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up's rows (interleaved: gate even, up odd) as (gate rows, up rows)."""
    return t[:, 0::2], t[:, 1::2]


class CheckpointExperts:
    """A checkpoint's MXFP4 expert stacks served by canonical key: `get` decodes "<i>.experts.gate", ".up" and
    ".down" to float32 [experts, out, in]; `kquant` gives them as the GGUF's MXFP4 rows for experts kept 4-bit
    (moe_loading.KQuantGetter). `read(key)` reads a checkpoint tensor by canonical key ("<i>.experts.gate_up_blocks",
    ...), or None."""

    def __init__(self, read: Callable[[str], torch.Tensor | None]) -> None:
        self.read = read

    def _stack(self, key: str) -> tuple[torch.Tensor, torch.Tensor, str] | None:
        """(blocks, scales, which rows: "gate", "up" or "all") of a canonical expert key, or None."""
        layer, _, part = key.partition(".")
        fused = {"experts.gate": ("gate_up", "gate"), "experts.up": ("gate_up", "up"), "experts.down": ("down", "all")}
        if part not in fused:
            return None
        stack, rows = fused[part]
        blocks, scales = self.read(f"{layer}.experts.{stack}_blocks"), self.read(f"{layer}.experts.{stack}_scales")
        if blocks is None or scales is None:
            return None
        return blocks, scales, rows

    def get(self, key: str) -> torch.Tensor | None:
        found = self._stack(key)
        if found is None:
            return None
        blocks, scales, rows = found
        if rows != "all":
            blocks, scales = (split_gate_up(t)[rows == "up"] for t in (blocks, scales))
        return decode(blocks, scales, key)

    def kquant(self, keys: list[str], kinds: tuple[str, ...]) -> tuple[str, list[torch.Tensor]] | None:
        if "MXFP4" not in kinds or not kquant_weight.available():
            return None
        out = []
        for key in keys:
            found = self._stack(key)
            if found is None:
                return None
            blocks, scales, rows = found
            if rows != "all":
                blocks, scales = (split_gate_up(t)[rows == "up"] for t in (blocks, scales))
            out.append(gguf_rows(blocks, scales, key))
        return "MXFP4", out
