"""What every probe shares: its options, its result line, and the checks it gathers on the way."""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field

MIB = 1 << 20
# The most a single request may add to the engine's resident memory, in multiples of --max-request-mib. A prompt
# is held as the body's bytes, the parser's string, the validated copy and the rendered prompt before its length is
# refused: 3.8x the limit for one long text, up to 7.3x for text spread over many messages or a tool's description
# (measured at 30 MB under 32 MiB; docs/DEVELOPERS.md). 10 is that worst case with room for the allocator.
RSS_FACTOR = 10
QUIET_LIMIT_S = 60.0  # an engine still busy this long after its clients all left did not stop for them
EXIT_S = 10.0  # SIGTERM ends an engine with nothing to write within this many seconds (0.8 s idle, 2.5 s at load 7)
QUIET_CPU = 0.1  # "idle": under a tenth of a core (an idle engine uses ~0.003 of one)


@dataclass
class Options:
    quick: bool = False
    engine_args: list[str] = field(default_factory=list)
    workdir: str = ""
    load_clients: int = 8
    load_seconds: float = 60.0
    seed: int = 7

    @staticmethod
    def split_args(text: str) -> list[str]:
        return shlex.split(text) if text else []

    def folder(self, name: str) -> str:
        path = os.path.join(self.workdir, name)
        os.makedirs(path, exist_ok=True)
        return path


@dataclass
class Result:
    name: str
    status: str  # PASS, FAIL or SKIP
    figures: str

    def line(self) -> str:
        return f"{self.status:4s}  {self.name:22s}  {self.figures}"


@dataclass
class Checks:
    """Figures and failed expectations, gathered as a probe goes; `result` turns them into its line."""

    name: str
    figures: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def note(self, figure: str) -> None:
        self.figures.append(figure)

    def expect(self, ok: bool, failure: str) -> bool:
        if not ok:
            self.failures.append(failure)
        return ok

    def result(self) -> Result:
        if self.failures:
            return Result(self.name, "FAIL", "; ".join(self.failures) + " | " + "; ".join(self.figures))
        return Result(self.name, "PASS", "; ".join(self.figures))


def mib(n_bytes: float) -> str:
    return f"{n_bytes / MIB:.0f} MiB"


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p * (len(ordered) - 1) + 0.5))] if ordered else float("nan")


WORDS = ("alpha river orchard lantern copper meadow violet harbour ember quartz willow canyon saffron tundra "
         "marble falcon juniper cobalt prairie thistle").split()


def words(n: int, seed: int) -> str:
    """`n` words of plain text, the same for the same seed (a prompt the model reads as ~1.3 tokens a word)."""
    out, x = [], seed * 7919 + 1
    for _ in range(n):
        x = (x * 1103515245 + 12345) % 2**31
        out.append(WORDS[x % len(WORDS)])
    return " ".join(out)
