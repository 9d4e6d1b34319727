"""fla-core's fused chunked gated delta rule for CUDA prefill (the optional extra `fla`).

The PyTorch block scan in `gated_deltanet` is the reference and the fallback: it runs wherever fla-core is not
installed, on the CPU, and when `ENABLED` is switched off (tools/deltanet_bench.py times the two against each
other). fla-core scans in blocks of 64 tokens counted from the start of each call, so a chunk is handed over in
segments that start at absolute multiples of `BLOCK` (or at the chunk's start) and end at the requested
checkpoint positions: the blocks are those of a one-shot prefill, and the state at a checkpoint is the one the
kernel hands back (no second pass). Decode steps keep the PyTorch recurrence (one token per row).
"""

from __future__ import annotations

import importlib.util

import torch

ENABLED = True  # tools may switch it off to time the PyTorch path in the same process


def usable(device: torch.device) -> bool:
    """Whether prefill on `device` goes through fla-core."""
    return ENABLED and device.type == "cuda" and importlib.util.find_spec("fla") is not None


def segment_edges(start: int, end: int, block: int, cuts: list[int]) -> list[int]:
    """Edges of the calls for a chunk [start, end): the first block boundary after an unaligned start, the
    checkpoint positions inside, and `end`."""
    first = (start // block + 1) * block
    edges = {p for p in cuts if start < p < end} | {end}
    if start % block and first < end:
        edges.add(first)
    return sorted(edges)


def chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-major: q/k [L, H, Dk] (q already scaled), v [L, H, Dv], g/beta [L, H], state [H, Dk, Dv] ->
    (o [L, H, Dv], state), all float32, as `gated_deltanet.delta_rule_block` computes them."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    o, final = chunk_gated_delta_rule(
        q[None].contiguous(), k[None].contiguous(), v[None].contiguous(), g[None].contiguous(),
        beta[None].contiguous(), scale=1.0, initial_state=state[None].contiguous(), output_final_state=True)
    assert final is not None
    return o[0].float(), final[0].float()
