"""CPU threads per step: prefill with --threads, decode with --decode-threads.

Prefill is compute-bound and its matrices are large: every core helps (the bundled model's 512-token prefill
ran 507 tok/s on 2 threads against 276 on one). A decode step is hundreds of small memory-bound products, and
each of its parallel regions waits for every worker to wake: for a small model that wait is most of the work,
and a worker sharing its core with another program (the client, an editor, a browser) holds the whole step up.
Measured on the 2-core box (docs/BENCHMARKS.md): the bundled model (~90 MiB of weights read per token) streamed
~55 tok/s over HTTP with one decode thread against ~31-43 with two, quiet or busy; a 1B model (~550 MiB) streamed
17 tok/s with two against 13 with one on the quiet box. So by default a model that reads less than
SMALL_STEP_BYTES per decode step decodes on one thread, a larger one on the compute threads.
"""

from __future__ import annotations

import torch

SMALL_STEP_BYTES = 256 << 20
TORCH_DEFAULT_THREADS = torch.get_num_threads()  # before anything set it: PyTorch's choice (the physical cores)


def decode_read_bytes(model: torch.nn.Module) -> int:
    """About the weight bytes a decode step reads: every tensor and packed weight the model holds but its token
    embedding (a step looks up one row of it); all experts of a mixture-of-experts model count."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        values = [*module._buffers.items(), *module._parameters.items(), *vars(module).items()]
        for name, value in values:
            for w in value if isinstance(value, list) else [value]:
                nbytes = getattr(w, "nbytes", None)
                if name == "embed" or not isinstance(nbytes, int) or id(w) in seen:
                    continue
                if isinstance(w, torch.Tensor) and w.device.type == "meta":
                    continue
                seen.add(id(w))
                total += nbytes
    return total


def default_decode_threads(compute_threads: int, step_bytes: int) -> int:
    """--decode-threads 0: one thread for a model that reads less than SMALL_STEP_BYTES a step, else the compute
    threads."""
    return 1 if step_bytes < SMALL_STEP_BYTES else compute_threads


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
