"""Speculative decoding with the model's own next-token layer (`--spec mtp`, GLM-4.x MoE): the layer proposes
the next tokens from the target's hidden rows, and the target verifies them in its decode step as it verifies
every draft (engine/runtime/scheduler.py `_verify`), so greedy output is the target's own, token for token.

The MTP layer's row t reads the target's hidden row at t (after its final norm) and the token at t+1 and predicts the token at t+2
(engine/model/mtp_layer.py). With a sequence of L tokens the target has computed its rows 0 .. L-2 (the last
token is fed in the step that verifies), so the layer's row L-2 proposes token L; each further draft token
comes from a row that reads the previous draft token and the layer's own output row in place of the target's.

Per slot the layer keeps its K/V rows and the tokens they were computed for (`held`), like a draft model
(draft_model.py): a slot that goes on reads only what was added. The target's hidden rows reach it through
`CausalLM.hidden_rows` (`TargetRows`) with the tokens they were computed for; where they do not cover the
sequence (a conversation restored from the cache: its rows were never computed here) no draft is made, so a
restore costs drafts, never a different answer.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from engine.model.mtp_layer import MtpBlock
from engine.runtime.slot_set import common_prefix
from engine.runtime.speculation import Length

if TYPE_CHECKING:
    from engine.model.llama import CausalLM, SeqChunk

log = logging.getLogger("strata.engine")

# Rows the layer reads per decode step while it catches up (a new conversation's prompt): the step every slot
# waits on grows by one such chunk at most, and the request decodes without drafts meanwhile.
CATCH_UP_CHUNK = 512


def declines(model: object) -> str:
    """Why `--spec mtp` cannot draft for `model` ("" when it can)."""
    mtp = getattr(model, "mtp", ())
    if not mtp:
        return "the model has no next-token (MTP) layers (GLM-4.x MoE files carry one; a file converted without it does not)"
    if getattr(model, "graphs", None) is not None:
        return "its decode step runs outside the eager path that hands over the hidden rows"
    return ""


class TargetRows:
    """The target's hidden rows (after its final norm) per slot and the tokens they were computed for (`CausalLM.hidden_rows`).

    A slot's rows grow with what it holds (doubling, in the model's dtype), so the cost is that of the contexts in
    use, not of `n_slots * ctx` rows of the model's width."""

    def __init__(self, n_slots: int) -> None:
        self.rows: list[torch.Tensor] = [torch.empty(0) for _ in range(n_slots)]
        self.tokens: list[list[int]] = [[] for _ in range(n_slots)]

    def __call__(self, chunks: list[SeqChunk], offsets: list[int], x: torch.Tensor) -> None:
        for ch, lo, hi in zip(chunks, offsets, offsets[1:], strict=False):
            seen = self.tokens[ch.slot]
            if ch.start > len(seen):  # rows computed elsewhere (a restore): -1 never matches a token
                seen.extend([-1] * (ch.start - len(seen)))
            del seen[ch.start :]
            seen.extend(ch.tokens.tolist())
            end = ch.start + hi - lo
            rows = self.rows[ch.slot]
            if rows.shape[0] < end:
                grown = torch.empty(max(end, 2 * rows.shape[0], 64), x.shape[1], dtype=x.dtype)
                if rows.numel():
                    grown[: rows.shape[0]] = rows
                self.rows[ch.slot] = rows = grown
            rows[ch.start : end] = x[lo:hi].to("cpu")

    def get(self, slot: int, start: int, end: int) -> torch.Tensor:
        """The slot's rows [start, end) as float32."""
        assert end <= len(self.tokens[slot]), (slot, end)
        return self.rows[slot][start:end].float()


class MtpSource:
    """The next-token layer drafting for every slot (speculation.DraftSource; engine thread only)."""

    def __init__(self, model: CausalLM, n_slots: int, ctx: int) -> None:
        assert not declines(model), declines(model)
        self.block = MtpBlock(model, model.mtp[0])
        self.ctx = ctx
        self.target = TargetRows(n_slots)
        model.hidden_rows = self.target
        self.caches = [self.block.new_cache(0) for _ in range(n_slots)]  # grown as TargetRows' rows
        # the tokens s_0 .. s_m of the slot's rows 0 .. m-1 (row t read s_{t+1} and the target's row t)
        self.held: list[list[int]] = [[] for _ in range(n_slots)]
        self.catch_up = CATCH_UP_CHUNK
        log.info("--spec mtp: drafting with the model's next-token layer (float32 on the CPU)")

    def drafter(self, slot: int, prompt: list[int], draft_max: int) -> MtpDrafter:
        """A request's drafter in `slot` (speculation.DraftSource)."""
        return MtpDrafter(self, slot, prompt, draft_max)

    def propose(self, slot: int, sequence: list[int], k: int) -> list[int]:
        """The layer's `k` greedy tokens after `sequence` in `slot`; none where the target's rows of the sequence
        are not all here, and none while more than `catch_up` rows are still to read (a chunk is read per call)."""
        n = len(sequence)
        k = min(k, self.ctx - n + 1)  # the last proposed token is never fed: it needs no row
        if k <= 0 or n < 2 or common_prefix(self.target.tokens[slot], sequence) < n - 1:
            return []
        rows = min(max(0, common_prefix(self.held[slot], sequence) - 1), n - 2)  # row n-2's logits are needed
        end = min(n - 1, rows + self.catch_up)
        cache = self._cache(slot, n - 2 + k)
        logits, out = self.block.forward(torch.tensor(sequence[rows + 1 : end + 1]),
                                         self.target.get(slot, rows, end), rows, cache)
        self.held[slot] = sequence[: end + 1]
        if end < n - 1:  # a long way behind: drafts once caught up
            return []
        proposed = [int(torch.argmax(logits[-1]))]
        hidden = out[-1:]
        while len(proposed) < k:  # rows past n-2 read draft tokens: not held, overwritten by the next catch-up
            logits, hidden = self.block.forward(torch.tensor(proposed[-1:]), hidden, n - 2 + len(proposed), cache)
            proposed.append(int(torch.argmax(logits[0])))
        return proposed

    def _cache(self, slot: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot's K/V rows, grown (doubling, at most `ctx`) to hold at least `rows` positions."""
        cache = self.caches[slot]
        have = cache[0].shape[0]
        if have < rows:
            grown = self.block.new_cache(min(self.ctx, max(rows, 2 * have, 64)))
            for old, new in zip(cache, grown, strict=True):
                new[:have] = old
            self.caches[slot] = cache = grown
        return cache


class MtpDrafter:
    """One request's next-token-layer drafts and their adaptive length (speculation.Drafts)."""

    def __init__(self, source: MtpSource, slot: int, prompt: list[int], draft_max: int) -> None:
        assert draft_max >= 1, draft_max
        self.source = source
        self.slot = slot
        self.prompt = list(prompt)
        self.length = Length(draft_max)
        self.drafted = self.accepted = 0
        self.reused = 0

    def draft(self, generated: list[int], room: int) -> list[int]:
        """Up to `room` (and the current length) tokens to follow prompt + `generated`."""
        k = min(room, self.length.want())
        return self.source.propose(self.slot, self.prompt + generated, k) if k > 0 else []

    def record(self, drafted: int, accepted: int) -> None:
        """A verify's outcome: `accepted` of `drafted` tokens were the target's own."""
        assert 0 <= accepted <= drafted and drafted > 0, (accepted, drafted)
        self.drafted += drafted
        self.accepted += accepted
        self.length.record(drafted, accepted)
