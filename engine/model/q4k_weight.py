"""CPU weights kept in a GGUF's own Q4_K blocks, multiplied by the native kernel without converting them.

The routed experts of a mixture-of-experts model are most of its bytes, and a Q4_K_M file holds most expert
stacks as Q4_K. Converted to the native kernel's Q4 runs (float16 scale and minimum per group of 32) they cost a
pass over every expert at every start (~1.2 s for a 270 MiB model on the 2-core box, minutes for a 17 GB one)
and differ from the file by the float16 rounding of each group's d x scale. Kept as the file's 144-byte blocks
(256 values each: float16 d and dmin, 6-bit scales and minimums, 4-bit codes) they are the bytes read from the
file, and kernels/blocks.c's q4k_matmul multiplies them with the same int16 activations and integer dot products
as the other native products.
"""

from __future__ import annotations

import torch

from engine.model import kernels

VALUES = 256  # a Q4_K block's values
BLOCK_BYTES = 144


def available() -> bool:
    """Whether Q4_K rows can be multiplied here (the native kernels load)."""
    return kernels.library() is not None


def row_bytes(cols: int) -> int:
    assert cols % VALUES == 0, cols
    return cols // VALUES * BLOCK_BYTES


class Q4KWeight(kernels.RowsWeight):
    """An [out, in] weight as Q4_K rows (uint8 [out, in / 256 * 144], the file's bytes); x @ w.T through the native
    q4k_matmul, float32 in and out. Every row is computed on its own with the same operations whatever the other
    rows or the threads."""

    product_name = "q4k_matmul"

    def __init__(self, blocks: torch.Tensor, shape: tuple[int, int]) -> None:
        n, k = shape
        assert blocks.dtype == torch.uint8 and tuple(blocks.shape) == (n, row_bytes(k)), (
            blocks.dtype, tuple(blocks.shape), shape)
        assert blocks.is_contiguous() and blocks.device.type == "cpu", "the kernel reads contiguous host rows"
        self.blocks = blocks
        self.shape = (n, k)
        self.dtype = torch.float32
        self.device = blocks.device



def expert_rows(stacks: list[torch.Tensor], shape: tuple[int, int, int]) -> list[Q4KWeight]:
    """One Q4KWeight per expert from Q4_K stacks (each uint8 [n_experts, rows_i, row bytes], the file's bytes)
    fused by rows: expert e's weight is every stack's rows of expert e, in order. `shape`: [n_experts, sum of
    rows_i, cols]."""
    e, rows, cols = shape
    fused = stacks[0] if len(stacks) == 1 else torch.cat(stacks, dim=1)
    assert tuple(fused.shape) == (e, rows, row_bytes(cols)), (tuple(fused.shape), shape)
    fused = fused.contiguous()
    return [Q4KWeight(fused[j], (rows, cols)) for j in range(e)]
