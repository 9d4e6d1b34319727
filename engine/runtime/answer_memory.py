"""The engine's recent answers, which prompt lookup also drafts from (engine/runtime/speculation.py).

A conversation's own tokens hold what it read; what the model wrote for another request is not in them. Yet agents
ask for it again: a retried or regenerated turn, a subagent's result that the main agent relays, the same edit
asked of two conversations. Every finished prompt-lookup request leaves its answer here, behind the last
`speculation.MATCH_MAX` tokens of its prompt (the context its first tokens are matched by), and drafting looks here
as well as in the conversation, taking whichever earlier occurrence matches the longer context (llama.cpp's
`--spec-type ngram-mod` keeps a server-wide table of n-grams for the same reason).

Bounded: the oldest answers are dropped past CAPACITY tokens. Kept in RAM only, and emptied by any purge and by
dropping a conversation, since it holds text of conversations a user may have asked to forget (one answer's
entry is not told from another's: all go), and a request running then leaves its answer out too. Drafts are verified by the target model, a sampled row with its own
draw (Sampler.verify), so what is found here can change only how fast an answer comes, never what it says.
Engine thread only.
"""

from __future__ import annotations

from collections import deque

CAPACITY = 1 << 16  # tokens kept: tens of answers, a few MiB of Python lists and index
BOUNDARY = -1  # between two entries: no token id equals it, so no match or draft runs across it


class AnswerMemory:
    """Recent answers with their prompt's tail, indexed by token."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        assert capacity > 0, capacity
        self.capacity = capacity
        self.tokens: list[int] = []
        self._at: dict[int, list[int]] = {}  # token -> its positions in `tokens`, ascending
        self._sizes: deque[int] = deque()  # each entry's length with its boundary, oldest first
        self.epoch = 0  # how many times it was emptied: a request begun before the last `clear` adds nothing

    def add(self, context: list[int], answer: list[int], epoch: int) -> None:
        """Keep `answer` behind `context` (the prompt's tail) of a request begun in `epoch`; the oldest entries go
        past the capacity. An answer from before the last `clear` is dropped: a purge or a dropped conversation
        while it ran may be forgetting its text."""
        if not answer or epoch != self.epoch:
            return
        entry = [*context, *answer][-(self._kept() - 1):]  # a longer one keeps its newest tokens
        base = len(self.tokens)
        self.tokens.extend(entry)
        self.tokens.append(BOUNDARY)
        for i, t in enumerate(entry):
            self._at.setdefault(t, []).append(base + i)
        self._sizes.append(len(entry) + 1)
        if len(self.tokens) > self.capacity:
            self._shrink()

    def _shrink(self) -> None:
        """Drop the oldest entries until a quarter of the capacity is free (so this runs once per many adds)."""
        drop = 0
        while self._sizes and len(self.tokens) - drop > self._kept():
            drop += self._sizes.popleft()
        del self.tokens[:drop]
        self._at = {}
        for i, t in enumerate(self.tokens):
            if t != BOUNDARY:
                self._at.setdefault(t, []).append(i)

    def _kept(self) -> int:
        return max(2, self.capacity * 3 // 4)

    def places(self, token: int) -> list[int]:
        """Where `token` occurs, ascending (do not modify)."""
        return self._at.get(token, [])

    def after(self, position: int, k: int) -> list[int]:
        """Up to `k` tokens after `position`, stopping at the end of its entry."""
        out = self.tokens[position + 1 : position + 1 + k]
        return out[: out.index(BOUNDARY)] if BOUNDARY in out else out

    def clear(self) -> None:
        self.tokens, self._at = [], {}
        self._sizes.clear()
        self.epoch += 1
