"""The output matrix read from the GGUF's own Q8_0 blocks (int4 weights, where the native kernels load).

A tied output matrix is the token embedding, which small GGUF models ship as Q8_0 (the bundled SmolLM2 does).
4-bit groups re-quantised from it moved the bundled model's logits 2-19 % (relative L2) from the file's values,
enough to change greedy text ("Say hello." gave "Hello there! I'shine."). With the native kernel the output
product reads the embedding table's own blocks (engine/model/quant_embedding.py), shared with the token lookup:
the file's values exactly, no second copy of the matrix (the 4-bit copy was 17 MiB for the bundled model), at
8.5 bits a weight read per step instead of 5.
"""

from __future__ import annotations

from gguf import GGMLQuantizationType

from engine.model import int4, kernels
from engine.model.q8_weight import Q8Weight
from engine.model.quant_embedding import QuantEmbedding


def can_read(table: object) -> bool:
    """Whether `table` (a kept embedding, or anything else) can serve as the output matrix here: Q8_0 blocks on
    the CPU and the native kernels loaded, whichever 4-bit kernel the projections use (with PyTorch's, forced by
    STRATA_INT4_KERNEL=aten, the bundled model's wrong answers came mostly from a 4-bit output matrix)."""
    return (isinstance(table, QuantEmbedding) and table.qtype == GGMLQuantizationType.Q8_0
            and table.shape[1] % int4.GROUP == 0 and table.device.type == "cpu" and kernels.library() is not None)


class Q8Output(Q8Weight):
    """x @ table.T over a QuantEmbedding's Q8_0 blocks (the table's own tensor, not a copy); float32 in and out.
    Every row is computed on its own with the same operations whatever the other rows or the threads
    (engine/model/kernels/blocks.c)."""

    def __init__(self, table: QuantEmbedding) -> None:
        assert can_read(table), (table.qtype, table.shape)
        super().__init__(table.blocks, (table.shape[0], table.shape[1]))
