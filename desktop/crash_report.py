"""What a crash cost the conversation cache: the parked conversations it lost (held in RAM, or still being
written) and those it kept (published on disk, indexed again when the engine restarts).

Worked out from the last `/cache/conversations` snapshot the app had before the engine died: the engine lists a
conversation once per tier that holds it; a disk row with `on_disk` is a published file, which survives a kill.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable
from dataclasses import dataclass

from desktop.client import MemorySample
from desktop.engine_process import ProcessOutcome
from desktop.settings import SUMMED_BYTES, format_bytes
from engine.contract import ConversationRow

LOW_MEMORY_FRACTION = 0.05  # free RAM below this share of the total (or LOW_MEMORY_BYTES) counts as nearly none
LOW_MEMORY_BYTES = 256 << 20


@dataclass(frozen=True, slots=True)
class CacheLoss:
    lost: int  # conversations with no published copy on disk
    lost_bytes: int
    kept: int  # conversations with a published copy on disk
    kept_bytes: int
    age_s: float  # how old the snapshot was when the engine died

    def describe(self) -> str:
        """'Lost: 2 parked conversations held in RAM or not yet written (3.1 MiB). Kept: 1 parked conversation
        on disk (1.2 MiB), restored when the engine starts again.'"""
        as_of = f" (as last reported {self.age_s:.0f} s before the engine ended)" if self.age_s >= 2 else ""
        if self.lost == 0 and self.kept == 0:
            return f"No parked conversations were lost: none were parked{as_of}."
        lost = (f"Lost: {_conversations(self.lost)} held in RAM or not yet written ({format_bytes(self.lost_bytes)})"
                if self.lost else "Lost: none")
        kept = (f"Kept: {_conversations(self.kept)} on disk ({format_bytes(self.kept_bytes)}), restored when the "
                "engine starts again" if self.kept else "Kept: none on disk")
        summed = f" {SUMMED_BYTES}" if self.lost + self.kept > 1 else ""
        return f"{lost}. {kept}{as_of}.{summed}"


def _conversations(n: int) -> str:
    return f"{n} parked conversation{'s' if n != 1 else ''}"


def cache_loss(rows: Iterable[ConversationRow], age_s: float) -> CacheLoss:
    """Lost and kept conversations (with their bytes) from the engine's conversation rows, one per tier."""
    tiers: dict[str, dict[str, int]] = {}  # id -> bytes held in RAM / published on disk / pending
    for row in rows:
        conv = tiers.setdefault(row.id, {"ram": 0, "disk": 0, "pending": 0})
        if row.tier == "disk":
            conv["disk" if row.on_disk else "pending"] += row.bytes
        else:
            conv["ram"] += row.bytes
    kept = {cid: t["disk"] for cid, t in tiers.items() if t["disk"]}
    lost = {cid: t["ram"] + t["pending"] for cid, t in tiers.items() if cid not in kept}
    return CacheLoss(lost=len(lost), lost_bytes=sum(lost.values()), kept=len(kept), kept_bytes=sum(kept.values()),
                     age_s=max(age_s, 0.0))


def memory_note(outcome: ProcessOutcome, sample: MemorySample | None) -> str:
    """Why a SIGKILL nobody asked for may have come from the system: the host was nearly out of memory at the
    app's last sample ("" when it was not, or the end was something else)."""
    killed = outcome.signalled and not outcome.requested and outcome.exit_code == getattr(signal, "SIGKILL", 9)
    if not killed or sample is None:
        return ""
    if sample.host_available > max(sample.host_total * LOW_MEMORY_FRACTION, LOW_MEMORY_BYTES):
        return ""
    engine = f", the engine using {format_bytes(sample.engine_rss)}" if sample.engine_rss else ""
    return (f"The system was nearly out of memory ({format_bytes(sample.host_available)} of "
            f"{format_bytes(sample.host_total)} free at the last sample{engine}): most likely its out-of-memory "
            "killer ended the engine. Smaller RAM budgets, a smaller context or fewer slots need less.")
