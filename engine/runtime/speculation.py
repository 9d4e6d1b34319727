"""Speculative decoding by prompt lookup (`--spec prompt-lookup`): draft tokens found in the conversation's own
tokens, verified by the target model in the decode step (engine/runtime/scheduler.py).

Agents re-emit code and text they have just read, or that the model wrote for another request. The drafter finds
the earlier occurrence of the request's last token (in its own prompt + generated tokens, or in the engine's recent
answers, engine/runtime/answer_memory.py) whose preceding tokens match the longest (NGRAM_MIN to MATCH_MAX of them;
a tie keeps the conversation's own, then the most recent), and proposes the tokens that followed it (llama.cpp's
ngram drafts, "prompt lookup decoding"). The scheduler feeds
the last sampled token and the draft as one-token rows of the slot in one step; each row computes exactly what
the decode step of that token alone computes (the decode paths' batch invariance, engine/model/llama.py
`check_rows`), so the accepted tokens are the ones decoding without a draft gives, token for token; a sampled
request's drafts are kept or replaced by rejection sampling (engine/runtime/spec_sampling.py), which keeps its
distribution.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from engine.runtime.answer_memory import BOUNDARY, AnswerMemory
from engine.runtime.step_costs import StepCosts

if TYPE_CHECKING:
    from engine.runtime.memory import SlotMemory

log = logging.getLogger("strata.engine")

# The longest context compared. Four tokens find a copied line; telling the prompt's copy of a file from an earlier
# answer's edited copy of it takes the tokens back to the last edit.
MATCH_MAX = 32
NGRAM_MIN = 2  # a lone token repeats too often to predict what follows it
SCAN_LIMIT = 256  # occurrences of the last token looked at, newest first: a bounded cost per step
FIRST_LENGTH = 4  # draft length of a request's first draft
# Below this smoothed acceptance rate drafting pauses: prompt lookup's until the decode steps measured fit a line
# (engine/runtime/step_costs.py), a draft model's and the next-token layer's always (their own steps cost too).
MIN_RATE = 0.3
BACKOFF_FIRST, BACKOFF_MAX = 4, 64  # decode steps without drafting after a poor run, doubled while it stays poor


class Drafts(Protocol):
    """A request's drafter: prompt lookup's `Drafter`, or a draft model's (engine/runtime/draft_model.py)."""

    drafted: int
    accepted: int
    reused: int  # a draft model's: the tokens it held already at its first draft (0 for prompt lookup)

    def draft(self, generated: list[int], room: int) -> list[int]: ...

    def record(self, drafted: int, accepted: int) -> None: ...

    def finish(self, generated: list[int]) -> None:
        """The request ended with these tokens generated."""


class DraftSource(Protocol):
    """Where `--spec draft` / `mtp` take a request's drafter from (a draft model: engine/runtime/draft_model.py; the
    model's next-token layer: engine/runtime/mtp_drafts.py)."""

    def drafter(self, slot: int, prompt: list[int], draft_max: int) -> Drafts: ...


@dataclass(frozen=True, slots=True)
class Speculation:
    """The engine's speculation setting (`--spec`, `--spec-draft-max`) as it runs: on, or declined with why."""

    method: str
    draft_max: int
    declined: str = ""
    source: DraftSource | None = None  # --spec draft / mtp: the draft model or the next-token layer, given once built
    # what a row costs a decode step here (the scheduler notes every decode step): prompt lookup's break-even
    costs: StepCosts = field(default_factory=lambda: StepCosts(MIN_RATE))
    # prompt lookup's: the answers of the requests it drafted for, which later requests draft from too
    memory: AnswerMemory = field(default_factory=AnswerMemory)

    @classmethod
    def for_engine(cls, method: str, draft_max: int, memory: SlotMemory,
                   steps_verify: Callable[[str, int], str]) -> Speculation:
        """The one place that decides whether this engine can speculate losslessly; a decline is logged once.

        `steps_verify(method, rows_per_slot)`: why the model's steps cannot compute a slot's token and its drafts
        as decoding them one per step does ('' when they can: ModelRunner.verify_declines)."""
        assert method in ("off", "prompt-lookup", "draft", "mtp"), method
        why = ""
        if method != "off":
            why = memory.rewind_inexact() or steps_verify(method, draft_max + 1)
            if why:
                log.warning("--spec %s declined, decoding without drafts: %s", method, why)
        return cls(method, draft_max, why)

    def break_even(self) -> float | None:
        """The acceptance rate below which prompt lookup pauses drafting now; None with another method or none."""
        return self.costs.break_even() if self.method == "prompt-lookup" and not self.declined else None

    def drafter(self, prompt: list[int], slot: int) -> Drafts | None:
        """A request's drafter in `slot`, or None: speculation off or declined. Greedy and sampled requests alike:
        a sampled one's drafts are verified by rejection sampling (Sampler.verify), which keeps its distribution
        (both drafters propose their tokens deterministically, so the draft distribution is one-hot at them)."""
        if self.method == "off" or self.declined:
            return None
        if self.method in ("draft", "mtp"):
            assert self.source is not None, f"--spec {self.method} runs with its draft source"
            return self.source.drafter(slot, prompt, self.draft_max)
        return Drafter(prompt, self.draft_max, self.costs.break_even, self.memory)

    def forget(self) -> None:
        """A purge or a dropped conversation: the recent answers go too (they may hold the forgotten text)."""
        self.memory.clear()


class Drafter:
    """One request's prompt-lookup drafts and their adaptive length (engine thread only)."""

    def __init__(self, prompt: list[int], draft_max: int, break_even: Callable[[], float] | None = None,
                 memory: AnswerMemory | None = None) -> None:
        """`break_even`: the acceptance rate below which drafting pauses (StepCosts.break_even; MIN_RATE if None);
        `memory`: the engine's recent answers, drafted from too and given this request's answer at its end."""
        assert draft_max >= 1, draft_max
        self.memory = memory
        self._epoch = memory.epoch if memory is not None else 0  # a purge meanwhile: its answer is not kept
        self._context = prompt[-MATCH_MAX:]
        self.tokens: list[int] = []
        self._at: dict[int, list[int]] = {}  # token -> its positions in `tokens`, ascending
        self._generated = 0  # generated tokens already in `tokens`
        self.length = Length(draft_max, break_even or _fixed_rate)
        self.drafted = self.accepted = 0
        self.reused = 0
        self._add(prompt)

    def _add(self, tokens: list[int]) -> None:
        base = len(self.tokens)
        self.tokens.extend(tokens)
        for i, t in enumerate(tokens):
            self._at.setdefault(t, []).append(base + i)

    def draft(self, generated: list[int], room: int) -> list[int]:
        """Up to `room` (and the current length) tokens to follow prompt + `generated`; [] when nothing matches
        or drafting does not pay now."""
        self._add(generated[self._generated:])
        self._generated = len(generated)
        k = min(room, self.length.want())
        return lookup(self.tokens, self._at, k, self.memory) if k > 0 else []

    def record(self, drafted: int, accepted: int) -> None:
        """A verify's outcome: `accepted` of `drafted` tokens were the target's own."""
        assert 0 <= accepted <= drafted and drafted > 0, (accepted, drafted)
        self.drafted += drafted
        self.accepted += accepted
        self.length.record(drafted, accepted)

    def finish(self, generated: list[int]) -> None:
        """Leave the answer to the engine's recent answers, behind the prompt's tail it followed."""
        if self.memory is not None:
            self.memory.add(self._context, generated, self._epoch)


class Proposer(Protocol):
    """What drafts a slot's next tokens from a model of its own (a draft model, the next-token layer)."""

    reused: list[int]  # per slot: the tokens it held already when its current request first drafted

    def propose(self, slot: int, tokens: list[int], k: int) -> list[int]: ...


class SlotDrafter:
    """One request's drafts from a `Proposer` (a draft model's, the next-token layer's) and their adaptive length
    (engine thread only; speculation.Drafts)."""

    def __init__(self, proposer: Proposer, slot: int, prompt: list[int], draft_max: int) -> None:
        assert draft_max >= 1, draft_max
        self.proposer = proposer
        self.slot = slot
        self.prompt = list(prompt)
        self.length = Length(draft_max)
        self.drafted = self.accepted = 0
        self.reused = 0  # the tokens the proposer held already at its first draft (a switch-back's reuse)
        self._first = True

    def draft(self, generated: list[int], room: int) -> list[int]:
        """Up to `room` (and the current length) tokens to follow prompt + `generated`."""
        k = min(room, self.length.want())
        if k <= 0:
            return []
        out = self.proposer.propose(self.slot, self.prompt + generated, k)
        if self._first:
            self.reused, self._first = self.proposer.reused[self.slot], False
        return out

    def record(self, drafted: int, accepted: int) -> None:
        """A verify's outcome: `accepted` of `drafted` tokens were the target's own."""
        assert 0 <= accepted <= drafted and drafted > 0, (accepted, drafted)
        self.drafted += drafted
        self.accepted += accepted
        self.length.record(drafted, accepted)

    def finish(self, generated: list[int]) -> None:
        """A model's drafts need no answer kept: its own state carries the conversation."""


def lookup(tokens: list[int], at: dict[int, list[int]], k: int, memory: AnswerMemory | None = None) -> list[int]:
    """Up to `k` tokens that followed an earlier occurrence of `tokens`' last token, in `tokens` or in `memory`:
    the one whose preceding tokens match those of the end of `tokens` longest (up to MATCH_MAX, at least NGRAM_MIN
    tokens with the last one), a tie keeping `tokens`' own, then the more recent. `at` indexes `tokens` by token.
    [] when no suffix of NGRAM_MIN tokens occurred before."""
    end = len(tokens) - 1
    if end < NGRAM_MIN or k <= 0:
        return []
    own, own_n = _longest(tokens, tokens, at.get(tokens[end], []), end)
    if memory is not None and own_n < MATCH_MAX:
        found, found_n = _longest(tokens, memory.tokens, memory.places(tokens[end]), len(memory.tokens))
        if found_n > own_n:
            return memory.after(found, k)
    return tokens[own + 1 : own + 1 + k] if own >= 0 else []


def _longest(query: list[int], source: list[int], places: list[int], before: int) -> tuple[int, int]:
    """Of the last SCAN_LIMIT `places` (ascending positions in `source` of `query`'s last token) below `before`,
    newest first, the one whose preceding tokens match `query`'s longest: (position, tokens matched with the last
    one), or (-1, 0) when none matches NGRAM_MIN."""
    end = len(query) - 1
    best, best_n = -1, NGRAM_MIN - 1
    for i in range(len(places) - 1, max(-1, len(places) - 1 - SCAN_LIMIT), -1):
        p = places[i]
        if p >= before or source[p + 1] == BOUNDARY:  # the suffix itself; an entry's last token, nothing after it
            continue
        n = 1
        while n < MATCH_MAX and n <= min(p, end) and source[p - n] == query[end - n]:
            n += 1
        if n > best_n:  # newest first: a tie keeps the more recent
            best, best_n = p, n
            if n == MATCH_MAX:
                break
    return (best, best_n) if best >= 0 else (-1, 0)


def _fixed_rate() -> float:
    return MIN_RATE


@dataclass(slots=True)
class Length:
    """The draft length: doubled after a draft accepted whole, cut to what was accepted plus one after a rejection;
    no drafts for a while when the smoothed acceptance rate falls below `break_even()` (the extra rows would cost
    more decode time than the accepted tokens save), then one probe.

    The rate is that of the positions a verify decided: the accepted ones and the first rejected one. The tokens
    after a rejection were never judged, so accepted / drafted would under-count the chance of a token once those
    before it were accepted, which is what a drafted row's pay depends on (step_costs.py)."""

    draft_max: int
    break_even: Callable[[], float] = _fixed_rate
    current: int = 0
    rate: float = 1.0  # smoothed accepted / decided
    skip: int = 0  # decode steps left without drafting
    backoff: int = BACKOFF_FIRST

    def __post_init__(self) -> None:
        self.current = min(FIRST_LENGTH, self.draft_max)

    def want(self) -> int:
        if self.skip > 0:
            self.skip -= 1
            return 0
        return self.current

    def record(self, drafted: int, accepted: int) -> None:
        decided = accepted + (accepted < drafted)
        self.rate = 0.6 * self.rate + 0.4 * (accepted / decided)
        if accepted == drafted:
            self.current = min(self.draft_max, self.current * 2)
        else:
            self.current = max(1, accepted + 1)
        floor = self.break_even()
        if self.rate < floor:
            self.skip, self.backoff = self.backoff, min(BACKOFF_MAX, self.backoff * 2)
            self.rate = floor  # the probe after the pause decides alone whether drafting pays again
        elif accepted:
            self.backoff = BACKOFF_FIRST
