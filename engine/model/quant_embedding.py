"""The token-embedding table kept on the CPU in the GGUF file's own quantised blocks.

The input lookup reads a handful of rows a step, yet a float32 copy of the table is the largest single weight
of a small model (Gemma-3-270M: 262K x 640 values, 640 MiB, against 170 MiB of Q8_0 blocks in the file). So
where the float table is needed for nothing else, the model keeps the file's block bytes, one row of whole
blocks per token, and decodes only the rows a step looks up, with the loader's own dequantiser
(engine/model/gguf_dequant.py): the rows the layers see are bit for bit those of the float table.

Kept only on the CPU (a GPU decodes a whole table at load as fast as it reads it), for a block format (a plain
F32/F16/BF16 table stays as it is), and when the output matrix is not that same float table: a tied output with
`--cpu-weights float` multiplies by the float matrix every step, so that model keeps today's table.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.errors import ModelLoadError
from engine.model import gguf_dequant, int4

# Rows decoded and quantised at a time for the 4-bit output matrix: ~20 MiB of float32 for Gemma's width.
_QUANTIZE_ROWS = 8192


class QuantEmbedding:
    """A [vocab, hidden] table as the file's blocks: uint8 [vocab, bytes per row]; calling it with token ids
    gives their rows decoded to `dtype`."""

    def __init__(self, name: str, raw: torch.Tensor, qtype: int, shape: tuple[int, int], dtype: torch.dtype) -> None:
        assert raw.device.type == "cpu", raw.device
        self.blocks = gguf_dequant.row_blocks(name, raw, qtype, shape)  # ModelLoadError by name on a bad size
        self.qtype = qtype
        self.shape = shape
        self.dtype = dtype
        self.device = raw.device

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return gguf_dequant.decode_rows(self.blocks.index_select(0, ids), self.qtype, self.dtype)

    def int4_groups(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The table quantised to 4-bit groups (int4.quantize_groups) a slice of rows at a time, so that the
        float table never exists whole; every row's groups are computed on its own, so the result is the
        whole float table's."""
        n, k = self.shape
        codes = torch.empty(n, k, dtype=torch.uint8)
        scale, low = torch.empty(n, k // int4.GROUP), torch.empty(n, k // int4.GROUP)
        step = _QUANTIZE_ROWS
        for a in range(0, n, step):
            ids = torch.arange(a, min(n, a + step))
            codes[a : a + step], scale[a : a + step], low[a : a + step] = int4.quantize_groups(self(ids))
        return codes, scale, low


# The GGUF loader's getter of the table as blocks: the key, the dtype rows decode to; None when the file holds
# it in a plain float type.
BlocksGetter = Callable[[str, torch.dtype], "QuantEmbedding | None"]


def embed_rows(ids: torch.Tensor, table: torch.Tensor | QuantEmbedding, scale: torch.Tensor | None = None) -> torch.Tensor:
    """The embeddings of `ids` from a float table or a QuantEmbedding, times `scale` (Gemma) where given."""
    x = table(ids) if isinstance(table, QuantEmbedding) else F.embedding(ids, table)
    return x if scale is None else x * scale.to(x.device)


def kept_table(
    blocks: BlocksGetter | None, device: torch.device, dtype: torch.dtype, shape: tuple[int, int], path: str,
    *, float_output: bool,
) -> QuantEmbedding | None:
    """The embedding table as blocks where it can stand in for the float one (module docstring), else None.
    `float_output`: the output matrix would be this float table itself."""
    if blocks is None or device.type != "cpu" or float_output:
        return None
    table = blocks("embed", dtype)
    if table is not None and table.shape != shape:
        raise ModelLoadError(f"{path}: weight 'embed' has shape {table.shape}, expected {shape}")
    return table
