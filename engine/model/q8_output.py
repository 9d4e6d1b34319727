"""The output matrix read from the GGUF's own Q8_0 blocks (int4 weights, where the native kernels load).

A tied output matrix is the token embedding, which small GGUF models ship as Q8_0 (the bundled SmolLM2 does).
4-bit groups re-quantised from it moved the bundled model's logits 2-19 % (relative L2) from the file's values,
enough to change greedy text ("Say hello." gave "Hello there! I'shine."). With the native kernel the output
product reads the embedding table's own blocks (engine/model/quant_embedding.py), shared with the token lookup:
the file's values exactly, no second copy of the matrix (the 4-bit copy was 17 MiB for the bundled model), at
8.5 bits a weight read per step instead of 5.
"""

from __future__ import annotations

from typing import cast

import torch
from gguf import GGMLQuantizationType

from engine.model import int4, kernels
from engine.model.quant_embedding import QuantEmbedding

_BLOCK_BYTES = 34  # a float16 scale and 32 int8 codes


def can_read(table: object) -> bool:
    """Whether `table` (a kept embedding, or anything else) can serve as the output matrix here: Q8_0 blocks on
    the CPU and the native kernels loaded, whichever 4-bit kernel the projections use (with PyTorch's, forced by
    STRATA_INT4_KERNEL=aten, the bundled model's wrong answers came mostly from a 4-bit output matrix)."""
    return (isinstance(table, QuantEmbedding) and table.qtype == GGMLQuantizationType.Q8_0
            and table.shape[1] % int4.GROUP == 0 and table.device.type == "cpu" and kernels.library() is not None)


class Q8Output:
    """x @ table.T over a QuantEmbedding's Q8_0 blocks; float32 in and out. Every row is computed on its own with
    the same operations whatever the other rows or the threads (engine/model/kernels/blocks.c)."""

    def __init__(self, table: QuantEmbedding) -> None:
        assert can_read(table), (table.qtype, table.shape)
        n, k = table.shape
        assert tuple(table.blocks.shape) == (n, k // int4.GROUP * _BLOCK_BYTES), tuple(table.blocks.shape)
        self.blocks = table.blocks  # the embedding's own tensor, not a copy
        self.shape = (n, k)
        self.dtype = torch.float32
        self.device = table.device

    @property
    def nbytes(self) -> int:
        """The bytes a product reads (the embedding table's, which this shares)."""
        return self.blocks.nbytes

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        q8_matmul = cast(kernels.Library, kernels.library()).q8_matmul
        return kernels.product(q8_matmul, x, self.shape, self.blocks)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.mm(x)
