"""CPU threads per step: prefill with --threads, decode with --decode-threads.

Prefill is compute-bound and its matrices are large: every core helps (the bundled model's 512-token prefill
ran 507 tok/s on 2 threads against 276 on one). A decode step is hundreds of small memory-bound products, and
each of its parallel regions waits for every worker to wake: for a small model that wait is most of the work,
and a worker sharing its core with another program (the client, an editor, a browser) holds the whole step up.
Measured on the 2-core box (docs/BENCHMARKS.md): the bundled model (~90 MiB of weights read per token) streamed
~55 tok/s over HTTP with one decode thread against ~31-43 with two, quiet or busy; a 1B model (~550 MiB) streamed
17 tok/s with two against 13 with one on the quiet box. So by default a model that reads less than
SMALL_STEP_BYTES per decode step starts decoding on one thread, a larger one on the compute threads.

Which is faster depends on the moment as much as on the model: with workers that spin briefly before sleeping
(engine/cli.py) the native decode step of the bundled model took 7.4 ms on two threads against 13.8 on one on the
quiet box, and 58 ms against 11 with a busy loop on one of the two cores. So with --decode-threads 0 the engine
keeps measuring (DecodeThreadsProbe): every PERIOD decode steps it runs a few on the other count and keeps
whichever was faster. A row's results do not depend on the thread count (the kernels sum each output on one
thread in one order), so switching changes timing only.
"""

from __future__ import annotations

import statistics

import torch

from engine.runtime.protocols import Model

SMALL_STEP_BYTES = 256 << 20
TORCH_DEFAULT_THREADS = torch.get_num_threads()  # before anything set it: PyTorch's choice (the physical cores)


def decode_read_bytes(model: Model) -> int:
    """About the weight bytes a decode step reads: every tensor and packed weight the model holds but its token
    embedding (a step looks up one row of it); all experts of a mixture-of-experts model count."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        values = [*module.named_buffers(recurse=False), *module.named_parameters(recurse=False), *vars(module).items()]
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


class DecodeThreadsProbe:
    """Chooses between one decode thread and `compute` by timing decode steps as they run: after PERIOD steps on
    the current count (FIRST steps the first time, so that a new engine finds its count within its first reply),
    PROBE steps on the other (the first of them discarded: a count's first step pays for waking its workers); it
    switches when the probe's median step beats the median of the last PROBE steps before it, of the same row
    count, by MARGIN. Probing costs PROBE of every PERIOD + PROBE steps on the slower count."""

    FIRST = 8
    PERIOD = 64
    PROBE = 5
    MARGIN = 0.9

    def __init__(self, compute: int, start: int) -> None:
        assert compute > 1 and start in (1, compute), (compute, start)
        self.counts = (1, compute)
        self.current = start
        self._recent: list[tuple[int, float]] = []  # (rows, seconds) of the current count's latest steps
        self._probe: list[tuple[int, float]] = []
        self._until_probe = self.FIRST
        self.switches = 0

    def threads(self) -> int:
        """The count the next decode step runs on."""
        return self._other() if self._until_probe <= 0 else self.current

    def _other(self) -> int:
        return self.counts[1] if self.current == self.counts[0] else self.counts[0]

    def record(self, rows: int, seconds: float) -> None:
        """A decode step of `rows` one-token rows took `seconds` on `threads()`."""
        if self._until_probe > 0:
            self._recent = [*self._recent[-(self.PROBE - 1):], (rows, seconds)]
            self._until_probe -= 1
            return
        self._probe.append((rows, seconds))
        if len(self._probe) < self.PROBE:
            return
        probed = [s for r, s in self._probe[1:] if r == rows]
        before = [s for r, s in self._recent if r == rows]
        comparable = len(probed) == self.PROBE - 1 and len(before) >= self.PROBE - 1
        if comparable and statistics.median(probed) < self.MARGIN * statistics.median(before):
            self.current = self._other()
            self.switches += 1
        self._probe, self._recent, self._until_probe = [], [], self.PERIOD


class StepThreads:
    """Sets torch's thread count before each step when the kind of step changes (on the calling thread: OpenMP
    keeps the count per thread, and the warm-up runs on another thread than the engine loop). With `probe`, the
    decode count is DecodeThreadsProbe's, fed by `after_step`."""

    def __init__(self, compute: int, decode: int, *, probe: bool = False) -> None:
        assert compute >= 1 and decode >= 1, (compute, decode)
        self.compute = compute
        self._fixed_decode = decode
        self.probe = DecodeThreadsProbe(compute, decode) if probe and compute > 1 and decode in (1, compute) else None

    @property
    def decode(self) -> int:
        """The count the next decode step runs on (during a probe, the count being tried)."""
        return self.probe.threads() if self.probe is not None else self._fixed_decode

    @property
    def decode_choice(self) -> int:
        """The count decode steps run on between probes (what /metrics reports)."""
        return self.probe.current if self.probe is not None else self._fixed_decode

    def before_step(self, one_token_rows: bool) -> None:
        """Before a forward step: `one_token_rows` when every row of it is a single token (a decode step)."""
        want = self.decode if one_token_rows else self.compute
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)

    def after_step(self, one_token_rows: bool, rows: int, seconds: float) -> None:
        """After the step before_step prepared: its row count and how long its forward took."""
        if one_token_rows and self.probe is not None:
            self.probe.record(rows, seconds)
