"""Which GPU products give a row the same bits whatever the number of rows beside it: what speculation's verify
step (a token and its draft as rows of one step) and `--deterministic` rely on. Needs CUDA.

    python tools/row_invariance_probe.py [--rows 16]

For each projection shape of Llama-3-8B and of the bundled model, in bfloat16, and for each way the engine
multiplies decode rows (engine/model/projections.py: `linear` of one-token rows, `logit_rows`, `F.linear` over
all rows as the default CUDA step does, `bmm` for every row count), it runs 1 to --rows rows and prints the
(row count, row) pairs whose result differs from that row computed alone, and the time of 1 and 9 rows.
docs/DETAILS.md ("Why CUDA stays declined") has what an H100 showed.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.model import projections  # noqa: E402

Product = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
SHAPES = {"8B qkv": (6144, 4096), "8B o": (4096, 4096), "8B gate+up": (28672, 4096), "8B down": (4096, 14336),
          "8B output": (128256, 4096), "bundled qkv": (960, 576), "bundled up": (3072, 576),
          "bundled output": (49152, 576)}


def bmm_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.bmm(x.unsqueeze(1), w.t().expand(x.shape[0], -1, -1)).squeeze(1)


PRODUCTS: dict[str, Product] = {
    "linear (one-token rows)": lambda x, w: projections.linear(x, w, x.shape[0]),
    "logit_rows": lambda x, w: projections.logit_rows(x, w),
    "F.linear (the default CUDA step)": F.linear,
    "bmm for every count": bmm_rows,
}


def differing(product: Product, x: torch.Tensor, w: torch.Tensor) -> list[tuple[int, int]]:
    """(row count, row) pairs of 1..len(x) rows whose row differs, bit for bit, from that row alone."""
    alone = [product(x[j : j + 1], w)[0] for j in range(len(x))]
    out = []
    for m in range(1, len(x) + 1):
        rows = product(x[:m], w)
        out += [(m, j) for j in range(m) if not torch.equal(rows[j], alone[j])]
    return out


def microseconds(fn: Callable[[], torch.Tensor], n: int = 100) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n * 1000


def timed(product: Product, x: torch.Tensor, w: torch.Tensor) -> float:
    return microseconds(lambda: product(x, w))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=16, help="the most rows a product is run with (2..64)")
    args = p.parse_args(argv)
    if not 2 <= args.rows <= 64:
        p.error(f"--rows: expected 2 to 64, got {args.rows}")
    if not torch.cuda.is_available():
        print("row_invariance_probe: needs a CUDA device", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k, generator=gen, device="cuda") * 0.02).bfloat16()
        x = torch.randn(args.rows, k, generator=gen, device="cuda").bfloat16()
        for label, product in PRODUCTS.items():
            bad = differing(product, x, w)
            times = ", ".join(f"{m} rows {timed(product, x[:m], w):.1f} us" for m in (1, 9))
            verdict = "every row as alone" if not bad else f"{len(bad)} differ, first {bad[:4]}"
            print(f"{name} {n}x{k}, {label}: {verdict}; {times}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
