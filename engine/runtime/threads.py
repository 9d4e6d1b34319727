"""CPU threads per step: prefill with --threads, decode with --decode-threads.

Prefill is compute-bound and its matrices are large: every core helps (the bundled model's 512-token prefill
ran 507 tok/s on 2 threads against 276 on one). A decode step is hundreds of small, memory-bound products:
each of its parallel regions waits for every worker to wake, and a worker that shares its core with another
program (the client, an editor, a browser) holds the whole step up. On the 2-core box one decode thread beat two
over HTTP (~50 vs ~33 tok/s for the bundled model) and in-process for a 1B model too (13 vs 8.5 tok/s) while
anything else ran; docs/BENCHMARKS.md has the runs. So decode takes half the physical cores by default.
"""

from __future__ import annotations

import psutil
import torch


def default_decode_threads(compute_threads: int) -> int:
    """--decode-threads 0: half the physical cores, at least 1 and at most the compute threads."""
    cores = psutil.cpu_count(logical=False) or psutil.cpu_count() or 1
    return max(1, min(compute_threads, cores // 2))


class StepThreads:
    """Sets torch's thread count before each step when the kind of step changes (on the calling thread: OpenMP
    keeps the count per thread, and the warm-up runs on another thread than the engine loop)."""

    def __init__(self, compute: int, decode: int) -> None:
        assert compute >= 1 and decode >= 1, (compute, decode)
        self.compute, self.decode = compute, decode

    def before_step(self, one_token_rows: bool) -> None:
        """Before a forward step: `one_token_rows` when every row of it is a single token (a decode step)."""
        want = self.decode if one_token_rows else self.compute
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)
