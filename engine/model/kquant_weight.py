"""CPU weights kept in a GGUF's own K-quant blocks (Q4_K, Q6_K; and gpt-oss's MXFP4), multiplied by the native
kernels as they are.

The routed experts of a mixture-of-experts model are most of its bytes, and a Q4_K_M file holds most expert
stacks as Q4_K (some down stacks, its output matrix and value projections as Q6_K). Converted to the native
kernel's Q4 runs (float16 scale and minimum per group of 32) or to Q8_0 rows they cost a pass over every weight
at every start (~1.2 s for a 270 MiB model on the 2-core box, minutes for a 17 GB one), differ from the file by
the conversion's rounding (Q6_K to 4-bit groups moved Gemma-3-270M's logits 35 %), and Q8_0 rows read 8.5 bits a
weight where Q6_K reads 6.6. Kept as the file's blocks (Q4_K: 144 bytes for 256 values, float16 d and dmin, 6-bit
scales and minimums, 4-bit codes; Q6_K: 210 bytes, 6-bit codes, an int8 scale per 16 values, float16 d) they are
the bytes read from the file, and kernels/blocks.c's q4k_matmul and q6k_matmul multiply them with the same int16
activations and integer dot products as the other native products. An expert stack the file holds as Q8_0 is
kept likewise, as q8_weight.Q8Weight rows (the native kernel's 8-bit format is Q8_0's), instead of being rounded to
4-bit groups. So is an MXFP4 stack (gpt-oss's experts, 17 bytes for 32 values): its e2m1 codes are not an affine
4-bit grid, so 4-bit groups could not hold them; kernels/blocks.c's mxfp4_matmul multiplies the file's bytes.
"""

from __future__ import annotations

import torch

from engine.model import kernels
from engine.model.q8_weight import Q8Weight

VALUES = 256  # a K-quant block's values
BLOCKS = {"Q4_K": (VALUES, 144), "Q6_K": (VALUES, 210), "Q8_0": (32, 34), "MXFP4": (32, 17)}  # kind -> (values, bytes)


def available() -> bool:
    """Whether K-quant rows can be multiplied here (the native kernels load)."""
    return kernels.library() is not None


def row_bytes(cols: int, kind: str = "Q4_K") -> int:
    values, size = BLOCKS[kind]
    assert cols % values == 0, (cols, kind)
    return cols // values * size


class KQuantWeight(kernels.RowsWeight):
    """An [out, in] weight as the file's K-quant rows (uint8 [out, in / 256 * block bytes]); x @ w.T through the
    native product for its kind, float32 in and out. Every row is computed on its own with the same operations
    whatever the other rows or the threads."""

    kind = ""

    def __init__(self, blocks: torch.Tensor, shape: tuple[int, int]) -> None:
        n, k = shape
        assert blocks.dtype == torch.uint8 and tuple(blocks.shape) == (n, row_bytes(k, self.kind)), (
            blocks.dtype, tuple(blocks.shape), shape)
        assert blocks.is_contiguous() and blocks.device.type == "cpu", "the kernel reads contiguous host rows"
        self.blocks = blocks
        self.shape = (n, k)
        self.dtype = torch.float32
        self.device = blocks.device



class Q4KWeight(KQuantWeight):
    """Q4_K rows (144 bytes a block) through q4k_matmul."""

    product_name = "q4k_matmul"
    rows_code = 2
    kind = "Q4_K"


class Q6KWeight(KQuantWeight):
    """Q6_K rows (210 bytes a block) through q6k_matmul."""

    product_name = "q6k_matmul"
    rows_code = 3
    kind = "Q6_K"


class MXFP4Weight(KQuantWeight):
    """MXFP4 rows (17 bytes for 32 values: an e8m0 exponent, 32 e2m1 codes; gpt-oss's experts) through
    mxfp4_matmul."""

    product_name = "mxfp4_matmul"
    rows_code = 4
    kind = "MXFP4"


# The rows kept as the file holds them, by the file's type.
CLASSES: dict[str, type[KQuantWeight] | type[Q8Weight]] = {"Q4_K": Q4KWeight, "Q6_K": Q6KWeight, "Q8_0": Q8Weight,
                                                           "MXFP4": MXFP4Weight}


def q6k_to_q8_0(blocks: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """A Q6_K matrix (uint8 [rows, row bytes], the file's bytes) as Q8_0 rows, byte for byte what
    q8_weight.q8_0_rows makes of its float32 values, in one native pass instead of a float copy and PyTorch's
    passes over it; AssertionError where q8_0_rows would refuse the values (a scale beyond float16)."""
    rows, cols = shape
    assert blocks.dtype == torch.uint8 and tuple(blocks.shape) == (rows, row_bytes(cols, "Q6_K")), (
        blocks.dtype, tuple(blocks.shape), shape)
    src = blocks.contiguous()
    out = torch.empty(rows, cols // 32 * BLOCKS["Q8_0"][1], dtype=torch.uint8)
    lib = kernels.library()
    assert lib is not None, f"native kernels: {kernels.unavailable_reason()}"
    done = lib.q6k_to_q8_0(src.data_ptr(), rows * cols // VALUES, out.data_ptr(), torch.get_num_threads())
    assert done == 0, "8-bit scales beyond float16"
    return out


def expert_rows(kind: str, stacks: list[torch.Tensor], shape: tuple[int, int, int]) -> list[kernels.RowsWeight]:
    """One weight of `kind` (a key of CLASSES) per expert from stacks of it (each uint8 [n_experts, rows_i, row
    bytes], the file's bytes) fused by rows: expert e's weight is every stack's rows of expert e, in order.
    `shape`: [n_experts, sum of rows_i, cols]."""
    e, rows, cols = shape
    fused = stacks[0] if len(stacks) == 1 else torch.cat(stacks, dim=1)
    assert tuple(fused.shape) == (e, rows, row_bytes(cols, kind)), (tuple(fused.shape), shape, kind)
    fused = fused.contiguous()
    return [CLASSES[kind](fused[j], (rows, cols)) for j in range(e)]
