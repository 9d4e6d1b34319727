"""Every request explained: what of its prompt was reused and from where, and why the rest was computed.

`explain` turns what admission saw (the best live slot, the cache's `LookupReport`, what was restored) into a
reason and its detail; `RequestLog` keeps the last records (a bounded ring the engine thread appends to and
publishes whole with the stats snapshot) and counts each reason for /metrics.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from engine.cache.explain import LookupReport
from engine.contract import RequestRecord

REQUEST_LOG_SIZE = 1000
SPEC_CONVERSATIONS = 256  # conversations whose speculation figures /metrics keeps (each is a Prometheus label)
# Every reason a record can give (RequestRecord documents them); each is a Prometheus label, counted from 0.
REASONS = ("new_tokens", "diverged", "template", "evicted", "floor", "refused", "n_min", "similarity", "cost",
           "small_gain", "restore_failed", "window", "cold")
CONTEXT_TOKENS = 6  # tokens shown either side of where a prompt left its candidate
# The template's rewrite position is the text before it tokenized alone; the prompt's own tokens may merge across it.
REWRITE_SLACK = 2


@dataclass(frozen=True, slots=True)
class Candidate:
    """A live slot's contents as a candidate for the prompt's prefix."""

    label: str  # "slot 0"
    matched: int  # prompt tokens it shares (capped at the prompt's length - 1)
    tokens: Sequence[int]  # what it holds


@dataclass(frozen=True, slots=True)
class Admission:
    """What admission did with a prompt: the inputs of its explanation."""

    prompt: Sequence[int]
    reused: int
    source: str  # "live" | "ram" | "disk" | "none"
    live: Candidate | None  # the free slot sharing the most of the prompt
    report: LookupReport  # what the cache saw
    small_gain: bool = False  # a hit existed but saved fewer than the minimum over the live slot
    restore_failed: str = ""  # why a chosen hit could not be restored
    rewritten_at: int | None = None  # GenerationRequest.rewritten_at


Decode = Callable[[Sequence[int]], str]


def explain(adm: Admission, decode: Decode) -> tuple[str, dict[str, Any]]:
    """The reason the prompt's tokens past `adm.reused` were computed, and its detail (see RequestRecord)."""
    prompt, reused, report = adm.prompt, adm.reused, adm.report
    usable = len(prompt) - 1  # the last prompt token is always computed: its logits pick the first output
    assert 0 <= reused <= max(usable, 0), (reused, len(prompt))
    computed = {"computed": len(prompt) - reused}
    if adm.restore_failed:
        return "restore_failed", {**computed, "error": adm.restore_failed, "conversation_id": report.conversation_id}
    if reused >= usable:
        return "new_tokens", computed
    if report.verdict and report.matched > reused:
        return report.verdict, {**computed, **report.verdict_detail, "conversation_id": report.conversation_id}
    if report.window_shared > max(reused, report.matched):
        # shared with a parked conversation, but before its local layers' window: nothing to resume from there
        return "window", {**computed, "shared": report.window_shared, "resumable": report.matched,
                          "conversation_id": report.conversation_id}
    if report.loss is not None and report.loss["matched"] > reused:
        if report.loss_kind == "refuse":
            reason = "floor" if report.loss_refusal == "floor" else "refused"
        else:
            reason = "evicted"
        return reason, {**computed, **report.loss, "kind": report.loss_kind}
    if adm.small_gain:
        return "small_gain", {**computed, "offered": report.matched, "conversation_id": report.conversation_id}
    # The candidate that offered the most: a parked one (restored, or its prefix only) or the live slot.
    live = adm.live
    after: Sequence[int]
    if report.conversation_id is not None and (live is None or report.matched >= live.matched):
        label, matched, n_tokens = f"conversation {report.conversation_id}", report.matched, report.candidate_tokens
        after = report.window[matched - report.window_start:][:CONTEXT_TOKENS]
    elif live is not None and live.matched > 0:
        label, matched, n_tokens = live.label, live.matched, len(live.tokens)
        after = live.tokens[matched:matched + CONTEXT_TOKENS]
    else:
        return "cold", computed
    if matched >= n_tokens or matched == 0:
        # The prompt goes on from all of it: only tokens nothing held were computed. (matched 0 with a
        # candidate: nothing is shared.)
        return ("new_tokens", computed) if matched else ("cold", computed)
    # Left where the template wrote the history otherwise than before: not the client's change, the template's.
    template = adm.rewritten_at is not None and matched + REWRITE_SLACK >= adm.rewritten_at
    return "template" if template else "diverged", {
        **computed, "diverged_at": matched, **({"rewritten_at": adm.rewritten_at} if template else {}), "candidate": label, "candidate_tokens": n_tokens,
        "before": decode(prompt[max(0, matched - CONTEXT_TOKENS):matched]),
        "prompt_after": decode(prompt[matched:matched + CONTEXT_TOKENS]),
        "candidate_after": decode(after),
    }


class RequestLog:
    """The last REQUEST_LOG_SIZE records and the count of each reason (engine thread only; read as snapshots)."""

    def __init__(self, size: int = REQUEST_LOG_SIZE) -> None:
        self._ring: deque[RequestRecord] = deque(maxlen=size)
        self.reasons: dict[str, int] = dict.fromkeys(REASONS, 0)
        # conversation id -> [drafted, accepted] of its requests, the most recently speculated last
        self.spec: dict[str, list[int]] = {}

    def add(self, record: RequestRecord) -> None:
        assert record.reason in self.reasons, record.reason
        self._ring.append(record)
        self.reasons[record.reason] += 1

    def first_token(self, request_id: str, submitted: float) -> None:
        """The request's first token: its time to first token, from `submitted` (time.monotonic())."""
        self._update(request_id, ttft_ms=round((time.monotonic() - submitted) * 1000, 3))

    def speculated(self, request_id: str, drafted: int, accepted: int, draft_reused: int = 0) -> None:
        """The request's speculation at its end: draft tokens verified and accepted, and the tokens a draft
        model held already at its first draft."""
        record = self._update(request_id, spec_drafted=drafted, spec_accepted=accepted,
                              spec_draft_reused=draft_reused)
        if record is not None and record.conversation_id is not None:  # else counted when its id is known
            self._count_spec(record)

    def assign(self, request_ids: Sequence[str], conversation_id: str) -> None:
        """Requests served before their conversation had an id get the one its park gave it."""
        for rid in request_ids:
            record = self._update(rid, conversation_id=conversation_id)
            if record is not None:
                self._count_spec(record)

    def _count_spec(self, record: RequestRecord) -> None:
        assert record.conversation_id is not None
        if not record.spec_drafted:
            return
        totals = self.spec.pop(record.conversation_id, [0, 0])
        totals[0] += record.spec_drafted
        totals[1] += record.spec_accepted
        self.spec[record.conversation_id] = totals  # the most recent last
        while len(self.spec) > SPEC_CONVERSATIONS:  # a bounded number of labels: the oldest goes
            del self.spec[next(iter(self.spec))]

    def spec_figures(self) -> tuple[dict[str, int], dict[str, int]]:
        """(drafted, accepted) by conversation id."""
        return {c: t[0] for c, t in self.spec.items()}, {c: t[1] for c, t in self.spec.items()}

    def _update(self, request_id: str, **changes: Any) -> RequestRecord | None:
        ring = self._ring
        for i in range(len(ring) - 1, -1, -1):  # newest first: the request is nearly always among the last few
            if ring[i].request_id == request_id:
                ring[i] = replace(ring[i], **changes)
                return ring[i]
        return None

    def snapshot(self) -> tuple[RequestRecord, ...]:
        """The records, oldest first (immutable: any thread may read it)."""
        return tuple(self._ring)
