"""8-bit CPU weights (Q8_0 rows) for the projections a GGUF holds with more than 4 bits a weight.

A Q4_K_M file is not all 4-bit: llama.cpp's mix keeps some tensors as Q5_0, Q5_K, Q6_K or Q8_0 (Gemma-3-270M's
gate and up projections, half its down and value projections). Re-quantised to 4-bit groups they moved that
model's logits ~35 % (relative L2) from the file's values. Kept as Q8_0 rows (a float16 scale and 32 int8 codes
per block, the native kernel's q8_matmul) they stay within int8 rounding of the file (Q8_0 tensors exactly),
at 8.5 bits a weight read instead of the file's 5.5-6.6.

Used where the native kernels load (engine/model/kernels); elsewhere such tensors still become 4-bit groups.
"""

from __future__ import annotations

from typing import Self

import torch

from engine.model import kernels

GROUP = 32
BLOCK_BYTES = 34  # a float16 scale and 32 int8 codes, GGUF's Q8_0
_ROWS = 1024  # rows quantised at a time, so that the temporaries stay small next to an output matrix


def available() -> bool:
    """Whether 8-bit weights can be multiplied here (the native kernels load)."""
    return kernels.library() is not None


def q8_0_rows(w: torch.Tensor) -> torch.Tensor:
    """A float [n, k] weight as Q8_0 rows, uint8 [n, k // GROUP * BLOCK_BYTES]: per block of 32 the scale is the
    largest magnitude / 127 (rounded to float16) and each code round(value / scale). A weight that came from
    Q8_0 blocks gets its codes and scales back exactly."""
    n, k = w.shape
    assert k % GROUP == 0, (n, k)
    rows = torch.empty(n, k // GROUP, BLOCK_BYTES, dtype=torch.uint8)
    for a in range(0, n, _ROWS):
        blocks = w[a : a + _ROWS].float().view(-1, k // GROUP, GROUP)
        scale = (blocks.abs().amax(-1) / 127).to(torch.float16)
        assert scale.isfinite().all(), "8-bit scales beyond float16"
        safe = torch.where(scale == 0, torch.ones_like(scale), scale).float()
        codes = (blocks / safe.unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8)
        rows[a : a + _ROWS, :, :2] = scale.contiguous().view(torch.uint8).view(-1, k // GROUP, 2)
        rows[a : a + _ROWS, :, 2:] = codes.view(torch.uint8)
    return rows.view(n, -1)


def dequantize(rows: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """The float32 [n, k] matrix Q8_0 rows hold (tests, and a check on q8_0_rows)."""
    n, k = shape
    blocks = rows.view(n, k // GROUP, BLOCK_BYTES)
    scale = blocks[:, :, :2].contiguous().view(torch.float16).float()
    return (blocks[:, :, 2:].contiguous().view(torch.int8).float() * scale).view(n, k)


class Q8Weight(kernels.RowsWeight):
    """An [out, in] weight as Q8_0 rows; x @ w.T through the native q8_matmul, float32 in and out. Every row is
    computed on its own with the same operations whatever the other rows or the threads."""

    product_name = "q8_matmul"
    rows_code = 1

    def __init__(self, blocks: torch.Tensor, shape: tuple[int, int]) -> None:
        n, k = shape
        assert blocks.dtype == torch.uint8 and tuple(blocks.shape) == (n, k // GROUP * BLOCK_BYTES), (
            blocks.dtype, tuple(blocks.shape), shape)
        self.blocks = blocks
        self.shape = (n, k)
        self.dtype = torch.float32
        self.device = blocks.device

    @classmethod
    def from_float(cls, w: torch.Tensor) -> Self:
        return cls(q8_0_rows(w), (w.shape[0], w.shape[1]))

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor], shape: tuple[int, int]) -> Self:
        """From what `state()` returned (engine/model/weights_cache.py); ValueError when it is not that."""
        n, k = shape
        t = state.get("q8")
        if set(state) != {"q8"} or t is None or t.dtype != torch.uint8 or tuple(t.shape) != (n, k // GROUP * BLOCK_BYTES):
            raise ValueError(f"8-bit weight: expected q8 uint8 {(n, k // GROUP * BLOCK_BYTES)}, got "
                             f"{ {name: (v.dtype, tuple(v.shape)) for name, v in state.items()} }")
        return cls(t, shape)

    def state(self) -> dict[str, torch.Tensor]:
        return {"q8": self.blocks}
