"""fla-core's DeltaNet prefill (engine/model/hybrid/fla_kernels.py): where a chunk is cut into kernel calls, and
when the fused path applies. The kernel itself runs on CUDA only (tools/deltanet_bench.py compares it there)."""

from __future__ import annotations

import torch

from engine.model.hybrid import fla_kernels
from engine.model.hybrid.batch import segment_edges


def test_calls_start_on_the_scans_blocks_and_end_at_checkpoints():
    # An aligned start: one call up to each checkpoint, then to the end.
    assert fla_kernels.segment_edges(0, 2000, 64, [1024]) == [1024, 2000]
    # An unaligned start (a prompt end) first runs to the next block boundary, so later calls' 64-token blocks
    # are the PyTorch scan's (segment_edges at absolute multiples of the block).
    assert fla_kernels.segment_edges(100, 300, 64, [256]) == [128, 256, 300]
    assert fla_kernels.segment_edges(1024, 1100, 64, []) == [1100]
    assert fla_kernels.segment_edges(10, 50, 64, []) == [50]
    for start, end, cuts in ((0, 2000, [1024]), (100, 300, [256]), (70, 900, [512, 640])):
        fused = fla_kernels.segment_edges(start, end, 64, cuts)
        assert set(fused) <= set(segment_edges(start, end, 64, cuts))  # every cut is one the scan makes too
        assert set(cuts) & set(range(start + 1, end)) <= set(fused) and fused[-1] == end


def test_the_fused_path_is_for_cuda_only():
    assert not fla_kernels.usable(torch.device("cpu"))
    fla_kernels.ENABLED = False
    try:
        assert not fla_kernels.usable(torch.device("cuda"))
    finally:
        fla_kernels.ENABLED = True
