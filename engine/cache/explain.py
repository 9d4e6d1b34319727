"""What a lookup found and what the cache no longer holds, so each request can be explained.

`LookupReport` is a lookup's whole answer: the best parked candidate (how much of the prompt it matched, its
tokens around the point where the prompt left it), the policy's verdict with its predicted times, and the loss
that would have offered more. `Losses` is a bounded record of conversations evicted, purged, expired or refused,
so a later lookup can say why a prompt it would have matched was computed again.

A conversation that leaves a tier is remembered with its token ids (no state) and its circumstances: the kind
("evict", "purge", "expire", "refuse"), the tier, when, what caused it (the cause the cache set for the
operation in progress: the park of another conversation, a settings change, a purge), and which budget made
room (the byte budget or the slot count). A conversation that spilled from RAM to disk is remembered too, but
a lookup only reports a loss that matches more of the prompt than what is still parked, so it never blames an
eviction for a conversation that is in fact on disk. Every method runs with the cache's lock held.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.cache.index import Conv
from engine.cache.policy import common_prefix

EXPLAIN_WINDOW = 8  # candidate tokens kept either side of where a prompt leaves it, to show as text
MAX_LOSSES = 256  # conversations remembered; the oldest loss is forgotten first
MAX_LOSS_TOKENS = 1 << 22  # and at most this many token ids in all (16 MiB), whatever the context length
# The budget that made room, by tier, as the flag a person would change.
BYTE_BUDGETS = {"ram": "conversation-cache-mib", "disk": "conversation-cache-disk-mib"}
SLOT_BUDGET = "conversation-cache-slots"


@dataclass(frozen=True, slots=True)
class LookupReport:
    """What a lookup saw, used or not (plain data; the runtime turns it into a request's explanation)."""

    conversation_id: str | None = None  # the parked candidate offering the longest prefix, if any
    tier: str = ""
    matched: int = 0  # prompt tokens it offers
    candidate_tokens: int = 0  # tokens it holds
    window: tuple[int, ...] = ()  # its tokens [window_start, window_start + len) around `matched`
    window_start: int = 0
    verdict: str = ""  # why the policy declined it ("" = used or no candidate)
    verdict_detail: dict[str, Any] = field(default_factory=dict)  # thresholds and predicted times
    loss: dict[str, Any] | None = None  # the loss offering more than every candidate (Loss.describe)
    loss_kind: str = ""  # its kind ("evict", "purge", "expire", "refuse")
    loss_refusal: str = ""
    # a sliding-window model: the prompt tokens a candidate shares beyond every point a parked window lets a
    # restore resume from (its local layers keep only their last window: engine/cache/window.py); 0 = none
    window_shared: int = 0


@dataclass(slots=True)
class Loss:
    """One conversation the cache dropped or refused to keep."""

    tokens: np.ndarray  # int32 token ids (the same array the entry held: no copy)
    kind: str  # "evict" | "purge" | "expire" | "refuse"
    tier: str  # "ram" | "disk" | "" (a refused park)
    time: float
    conversation_id: str | None
    cause: dict[str, Any]  # shared with the operation that caused it, which may add the new entry's id
    budget: str = ""  # the flag whose limit made room (evictions only)
    refusal: str = ""  # a refused park's reason ("floor", "larger_than_budget", "no_room", ...)

    def describe(self, matched: int) -> dict[str, Any]:
        """The loss as a request explanation's detail (`matched`: the prompt tokens it would have offered)."""
        out: dict[str, Any] = {
            "lost_tokens": int(len(self.tokens)), "matched": matched, "tier": self.tier,
            "when": self.time, "conversation_id": self.conversation_id,
            "by": self.cause.get("by", ""),
        }
        if self.cause.get("conversation_id"):
            out["by_conversation"] = self.cause["conversation_id"]
        if self.budget:
            out["budget"] = self.budget
        if self.refusal:
            out["refusal"] = self.refusal
        return out


@dataclass(slots=True)
class Losses:
    """The bounded record of losses and the cause of the operation in progress."""

    records: deque[Loss] = field(default_factory=lambda: deque(maxlen=MAX_LOSSES))
    cause: dict[str, Any] = field(default_factory=lambda: {"by": "budget"})
    max_tokens: int = MAX_LOSS_TOKENS

    def begin(self, by: str, **about: Any) -> dict[str, Any]:
        """Name the cause of the evictions that follow (until the next `begin`); returns it to be completed."""
        self.cause = {"by": by, **about}
        return self.cause

    def dropped(self, tokens: np.ndarray, conversation_id: str, kind: str, tier: str, *, slots_full: bool) -> None:
        """A parked conversation left `tier` (`slots_full`: the slot count, not the byte budget, made room)."""
        budget = (SLOT_BUDGET if slots_full else BYTE_BUDGETS.get(tier, "")) if kind == "evict" else ""
        self._add(Loss(tokens, kind, tier, time.time(), conversation_id, self.cause, budget=budget))

    def refused(self, tokens: np.ndarray, reason: str) -> None:
        """A park was refused: the conversation was never kept."""
        self._add(Loss(tokens, "refuse", "", time.time(), None, self.cause, refusal=reason))

    def _add(self, loss: Loss) -> None:
        self.records.append(loss)
        total = sum(len(r.tokens) for r in self.records)
        while len(self.records) > 1 and total > self.max_tokens:
            total -= len(self.records.popleft().tokens)

    def best_match(self, tokens: np.ndarray, *, more_than: int) -> tuple[Loss, int] | None:
        """The most recent loss offering the longest prefix of `tokens`, if it beats `more_than` tokens."""
        usable = len(tokens) - 1
        best: tuple[Loss, int] | None = None
        for loss in reversed(self.records):
            if len(loss.tokens) == 0 or loss.tokens[0] != tokens[0]:
                continue
            n = min(common_prefix(tokens, loss.tokens), usable)
            if n > more_than and (best is None or n > best[1]):
                best = (loss, n)
        return best


def lookup_report(losses: Losses, toks: np.ndarray, best: tuple[int, str, Conv] | None,
                  live_prefix: int) -> LookupReport:
    """A lookup's report before the verdict: its best candidate (None, or (tokens matched, tier, entry)) and the
    loss that would have offered more than it and the live slot (cache lock held)."""
    matched = best[0] if best is not None else 0
    offered = max(matched, live_prefix)
    # Nothing can offer more than all of the prompt but its last token: no loss to look for then.
    lost = losses.best_match(toks, more_than=offered) if offered < len(toks) - 1 else None
    report = LookupReport() if lost is None else LookupReport(
        loss=lost[0].describe(lost[1]), loss_kind=lost[0].kind, loss_refusal=lost[0].refusal)
    if best is None or best[0] == 0:  # nothing shared: no candidate
        return report
    n, tier, conv = best
    lo = max(0, n - EXPLAIN_WINDOW)
    window = tuple(int(t) for t in conv.tokens[lo:n + EXPLAIN_WINDOW])
    return dataclasses.replace(report, conversation_id=conv.id, tier=tier, matched=n,
                               candidate_tokens=conv.n_tokens, window=window, window_start=lo)
