"""An entry's lifecycle: where its bytes are, as one explicit state with the legal transitions asserted.

    RAM ────────────────────────── (a RAM-tier entry: no disk lifecycle; leaves by eviction/purge)

    PENDING ──claim──▶ WRITING ──▶ WRITTEN
     (K/V in RAM,       (the writer    (its manifest is published: RAM keeps only the index)
      queued)            holds it)
                          └──────▶ FAILED (the write failed: the engine thread drops it, and the written version
                                           it was to replace, if any, comes back)

An entry built by a write the engine thread makes itself (a park bigger than the staging bound, a move to a new
folder) is created WRITING and moved to WRITTEN once its manifest is published; the start-up index creates
entries WRITTEN. Leaving the index is not a state: an entry evicted while WRITING keeps its state until the
writer reports, and its files go then.
"""

from __future__ import annotations

import enum


class EntryState(enum.Enum):
    RAM = "ram"
    PENDING = "pending"
    WRITING = "writing"
    WRITTEN = "written"
    FAILED = "failed"


LEGAL: dict[EntryState, frozenset[EntryState]] = {
    EntryState.RAM: frozenset(),
    EntryState.PENDING: frozenset({EntryState.WRITING}),
    EntryState.WRITING: frozenset({EntryState.WRITTEN, EntryState.FAILED}),
    EntryState.WRITTEN: frozenset(),
    EntryState.FAILED: frozenset(),
}


def check_transition(old: EntryState, new: EntryState) -> None:
    """Raise AssertionError for a transition the lifecycle does not have (a bug, never bad input)."""
    if new not in LEGAL[old]:
        raise AssertionError(f"illegal entry transition {old.value} -> {new.value}")
