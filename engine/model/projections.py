"""The projections' products: x @ w.T for every kind of weight the engine keeps (float, 4-bit groups, float16,
the native kernels' rows), with the rules that keep a row's result independent of the rows beside it.

Batch invariance: a slot's logits must not depend on what it was batched with, yet BLAS libraries pick a
different kernel (so a different summation order) by row count. Measured on x86 CPUs: oneDNN gives one
result for 1 row and another, identical for every count from 2 to 2100, for 2+ rows; MKL (F.linear) has
three classes (1, 2-3, 4+). So on CPU in float32 the projections run through oneDNN on all rows at once,
padded to at least 2 rows (oneDNN is also 1.5-2x faster than F.linear here), and logits are computed one
row at a time (the 1-row kernel is the fastest for the large vocabulary matrix). Elsewhere (CUDA, bf16)
rows of one-token chunks go through a batched gemv (`bmm` over a broadcast weight, at least 2 rows: a batch of
one is another kernel) and rows of longer chunks through one GEMM padded to `_MIN_GEMM_ROWS` rows. That is the
`--deterministic` path on CUDA; by default (`CausalLM.batch_invariant` False) every projection there is one
GEMM over all rows, which reads each weight once per step instead of once per decoding row.
The 4-bit, float16 and native-row weights compute each row on its own whatever the row count (their modules
say so), so they need no padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.float16 import Float16Weight
from engine.model.int4 import Int4Weight
from engine.model.kernels import RowsWeight

_MIN_GEMM_ROWS = 4
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _onednn(w: torch.Tensor) -> bool:
    return _ONEDNN and w.device.type == "cpu" and w.dtype == torch.float32


def _onednn_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, None, "none", [], "")


def _gemv_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # One row is padded to two: cuBLAS runs a batch of one as another kernel than a batch of two or more (an H100
    # gave other bits for 4096x4096 and 4096x14336), while batches of 2 to 256 gave each row the same bits.
    n = x.shape[0]
    if n == 1:
        x = torch.cat((x, x.new_zeros(1, x.shape[1])))
    return torch.bmm(x.unsqueeze(1), w.t().expand(x.shape[0], -1, -1)).squeeze(1)[:n]


def _gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    n = x.shape[0]
    if n >= _MIN_GEMM_ROWS:
        return F.linear(x, w)
    padded = torch.zeros(_MIN_GEMM_ROWS, x.shape[1], dtype=x.dtype, device=x.device)
    padded[:n] = x
    return F.linear(padded, w)[:n]


def linear(
    x: torch.Tensor, w: torch.Tensor | Int4Weight | Float16Weight | RowsWeight, n_single: int,
    bias: torch.Tensor | None = None, *,
    fast: bool = False,
) -> torch.Tensor:
    """x @ w.T where the first `n_single` rows are one-token chunks (see the module docstring).

    `fast` (float weights off the oneDNN path, i.e. CUDA unless --deterministic): one GEMM over every row,
    which reads the weights once for the whole batch; a row's last bits may then depend on the row count.
    With 4-bit weights the result is bfloat16; otherwise it has x's dtype."""
    if fast and isinstance(w, torch.Tensor) and not _onednn(w):
        y = F.linear(x, w)
    elif isinstance(w, Int4Weight):
        # bfloat16 as the kernel returns it: the callers add it to, or write it into, float32 tensors,
        # which converts it exactly and saves a conversion pass per projection.
        y = w.mm(x)
        if bias is not None:
            y = y.to(x.dtype)
    elif isinstance(w, (Float16Weight, RowsWeight)):  # rows independent of the row count (their modules say so)
        y = w.mm(x)
    elif _onednn(w):
        n = x.shape[0]
        if n == 1:
            x = torch.cat((x, x.new_zeros(1, x.shape[1])))
        y = _onednn_linear(x, w)[:n]
    elif n_single == x.shape[0]:
        y = _gemv_rows(x, w)
    elif n_single == 0:
        y = _gemm(x, w)
    else:
        y = torch.cat((_gemv_rows(x[:n_single], w), _gemm(x[n_single:], w)))
    if bias is not None:
        y += bias
    return y


def logit_rows(
    h: torch.Tensor, w: torch.Tensor | Int4Weight | Float16Weight | RowsWeight, *, fast: bool = False
) -> torch.Tensor:
    """Logits of each row of h on its own (the 1-row kernel, whatever else is in the batch); with `fast`
    (see `linear`) one GEMM over all rows."""
    if fast and isinstance(w, torch.Tensor) and not _onednn(w):
        return F.linear(h, w)
    if isinstance(w, Int4Weight):
        if fast or h.shape[0] == 1:  # CUDA 4-bit weights (engine.model.gpu_weights): one call over all rows
            return w(h)
        return torch.cat([w(h[i : i + 1]) for i in range(h.shape[0])])
    if isinstance(w, (Float16Weight, RowsWeight)):
        return w(h)
    if _onednn(w):
        if h.shape[0] == 1:
            return _onednn_linear(h, w)
        return torch.cat([_onednn_linear(h[i : i + 1], w) for i in range(h.shape[0])])
    return _gemv_rows(h, w)
