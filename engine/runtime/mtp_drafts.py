"""Speculative decoding with the model's own next-token layer (`--spec mtp`: GLM-4.x MoE, GLM-4.7-Flash, DeepSeek-V3, Qwen3-Next,
Qwen3.5): the layer proposes
the next tokens from the target's hidden rows, and the target verifies them in its decode step as it verifies
every draft (engine/runtime/scheduler.py `_verify`), so greedy output is the target's own, token for token.

The MTP layer's row t reads the target's hidden row at t (after its final norm) and the token at t+1 and predicts the token at t+2
(engine/model/mtp_layer.py). With a sequence of L tokens the target has computed its rows 0 .. L-2 (the last
token is fed in the step that verifies), so the layer's row L-2 proposes token L; each further draft token
comes from a row that reads the previous draft token and the layer's own output row in place of the target's.

Per slot the layer keeps its K/V rows and the tokens they were computed for (`held`), like a draft model
(draft_model.py): a slot that goes on reads only what was added. The target's hidden rows reach it through
`CausalLM.hidden_rows` (`TargetRows`; a hybrid's `HybridCausalLM.hidden_rows`, the same hook) with the tokens they
were computed for; where they do not cover the sequence no draft is made, so missing rows cost drafts, never a
different answer.

Both are parked with the conversation (engine/runtime/draft_states.py, as a draft model's K/V): token t's part
is the target's hidden row t and the layer's row t-1 (the one that read token t), so every prefix of a parked
part is a whole state (the layer's rows 0 .. n-2 and the target's 0 .. n-1 for n tokens) and a conversation
restored with it drafts at once. One restored without it (evicted, damaged, another model's) has no target rows
here for its restored tokens: the layer drafts over the rows computed after the restore only (`TargetRows.first`,
a context cut short: fewer drafts accepted, the same answer).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from engine.model.mtp_experts import held_bytes
from engine.model.mtp_layer import MtpBlock
from engine.runtime.slot_set import common_prefix
from engine.runtime.speculation import SlotDrafter

if TYPE_CHECKING:
    from engine.model.llama import CausalLM, SeqChunk

log = logging.getLogger("strata.engine")

# Rows the layer reads per decode step while it catches up (a new conversation's prompt): the step every slot
# waits on grows by one such chunk at most, and the request decodes without drafts meanwhile.
CATCH_UP_CHUNK = 512


def declines(model: object, available: int | None = None, int4_experts: bool = False) -> str:
    """Why `--spec mtp` cannot draft for `model` ("" when it can); `available`: the host RAM free for it (bytes);
    `int4_experts`: the layer's experts are to be held in 4-bit (the model's weights are int4 on the CPU)."""
    mtp = getattr(model, "mtp", ())
    if not mtp:
        return ("the model has no next-token (MTP) layers (GLM-4.x MoE, GLM-4.7-Flash, DeepSeek-V3, Qwen3-Next and Qwen3.5 "
                "files carry one; a file converted without it does not)")
    runner = getattr(model, "graphs", None)
    if runner is not None and not getattr(runner, "hands_over_hidden_rows", False):
        return "its decode step runs where the hidden rows the layer reads are not handed over (CUDA graphs)"
    # The layer runs in float32 on the CPU (mtp_layer.py), its experts in 4-bit with int4 weights: a large expert
    # block in float32 would not fit beside the model. Half of what is free, so the cache and the system keep room.
    need = held_bytes(mtp[0], int4_experts)
    if available is not None and need > available // 2:
        held = "with its experts in 4-bit" if int4_experts else "as float32"
        return (f"its next-token layer needs {need / 2**30:.1f} GiB {held}, more than half the "
                f"{available / 2**30:.1f} GiB of host RAM free")
    return ""


class TargetRows:
    """The target's hidden rows (after its final norm) per slot and the tokens they were computed for (`CausalLM.hidden_rows`).

    A slot's rows grow with what it holds (doubling, in the model's dtype), so the cost is that of the contexts in
    use, not of `n_slots * ctx` rows of the model's width."""

    def __init__(self, n_slots: int) -> None:
        self.rows: list[torch.Tensor] = [torch.empty(0) for _ in range(n_slots)]
        self.tokens: list[list[int]] = [[] for _ in range(n_slots)]
        # the first row computed here after rows that were not (their tokens -1): 0 unless the slot's K/V came
        # from a restore without the rows
        self.first: list[int] = [0] * n_slots

    def __call__(self, chunks: list[SeqChunk], offsets: list[int], x: torch.Tensor) -> None:
        for ch, lo, hi in zip(chunks, offsets, offsets[1:], strict=False):
            seen = self.tokens[ch.slot]
            if ch.start > len(seen):  # rows computed elsewhere (a restore): -1 never matches a token
                seen.extend([-1] * (ch.start - len(seen)))
                self.first[ch.slot] = ch.start
            elif ch.start < self.first[ch.slot]:  # rows before `first` are not read as context
                self.first[ch.slot] = ch.start
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

    def put(self, slot: int, start: int, rows: torch.Tensor) -> None:
        """Restored rows of positions start .. start+n-1 (their tokens are set by the caller)."""
        end = start + rows.shape[0]
        have = self.rows[slot]
        if have.shape[0] < end or have.dtype != rows.dtype or have.shape[1:] != rows.shape[1:]:
            grown = torch.empty(max(end, 2 * have.shape[0], 64), rows.shape[1], dtype=rows.dtype)
            if have.numel() and have.dtype == rows.dtype and have.shape[1:] == rows.shape[1:]:
                grown[: have.shape[0]] = have
            self.rows[slot] = have = grown
        have[start:end] = rows

    def get(self, slot: int, start: int, end: int) -> torch.Tensor:
        """The slot's rows [start, end) as float32."""
        assert end <= len(self.tokens[slot]), (slot, end)
        return self.rows[slot][start:end].float()


class MtpSource:
    """The next-token layer drafting for every slot (speculation.DraftSource; engine thread only)."""

    def __init__(self, model: CausalLM, n_slots: int, ctx: int, int4_experts: bool = False) -> None:
        assert not declines(model), declines(model)
        self.block = MtpBlock(model, model.mtp[0], int4_experts=int4_experts)
        self.ctx = ctx
        self.target = TargetRows(n_slots)
        model.hidden_rows = self.target
        self.caches = [self.block.new_cache(0) for _ in range(n_slots)]  # grown as TargetRows' rows
        # the tokens s_0 .. s_m of the slot's rows 0 .. m-1 (row t read s_{t+1} and the target's row t)
        self.held: list[list[int]] = [[] for _ in range(n_slots)]
        self.reused: list[int] = [0] * n_slots  # the tokens the slot's last read found held (its first draft's)
        # the position the slot's layer rows attend from: 0, or the target's `first` when its rows start there
        self.base: list[int] = [0] * n_slots
        self.dtype = model.dtype  # of the target's hidden rows, as parked
        self.catch_up = CATCH_UP_CHUNK
        log.info("--spec mtp: drafting with the model's next-token layer (on the CPU, %s)",
                 "its experts in 4-bit" if int4_experts else "float32")

    def drafter(self, slot: int, prompt: list[int], draft_max: int) -> SlotDrafter:
        """A request's drafter in `slot` (speculation.DraftSource)."""
        return SlotDrafter(self, slot, prompt, draft_max)

    def propose(self, slot: int, sequence: list[int], k: int) -> list[int]:
        """The layer's `k` greedy tokens after `sequence` in `slot`; none where the target's rows of the sequence
        are not here, and none while more than `catch_up` rows are still to read (a chunk is read per call).
        Where the target's rows start past 0 (a conversation restored without the layer's part), the layer reads
        and attends from there: shorter context, fewer drafts accepted, never a different answer."""
        n = len(sequence)
        self.reused[slot] = 0
        k = min(k, self.ctx - n + 1)  # the last proposed token is never fed: it needs no row
        lo = self.target.first[slot]
        if k <= 0 or n < 2 or lo > n - 2:
            return []
        if common_prefix(self.target.tokens[slot][lo:], sequence[lo:]) < n - 1 - lo:
            return []
        if self.base[slot] != lo:  # its rows attend from another position: read again from `lo`
            self.held[slot], self.base[slot] = [], lo
        held = common_prefix(self.held[slot], sequence)
        self.reused[slot] = min(held, n - 1)
        rows = min(max(lo, held - 1), n - 2)  # row n-2's logits are needed
        end = min(n - 1, rows + self.catch_up)
        cache = self._cache(slot, n - 2 + k)
        logits, out = self.block.forward(torch.tensor(sequence[rows + 1 : end + 1]),
                                         self.target.get(slot, rows, end), rows, cache, lo)
        self.held[slot] = sequence[: end + 1]
        if end < n - 1:  # a long way behind: drafts once caught up
            return []
        proposed = [int(torch.argmax(logits[-1]))]
        hidden = out[-1:]
        while len(proposed) < k:  # rows past n-2 read draft tokens: not held, overwritten by the next catch-up
            logits, hidden = self.block.forward(torch.tensor(proposed[-1:]), hidden, n - 2 + len(proposed), cache, lo)
            proposed.append(int(torch.argmax(logits[0])))
        return proposed

    def parkable(self, slot: int, tokens: Sequence[int]) -> int:
        """How many of `tokens` (the slot's, being parked) the slot's state covers (draft_states.DraftRows): the
        layer first reads the rows it lags behind the target by (the last verify's tokens, at most a catch-up
        chunk), so a parked conversation resumes drafting with nothing to read."""
        if self.target.first[slot] > 0:  # the target's rows of its first tokens are not here: nothing to park
            return 0
        if self.base[slot] > 0:  # rows of a context cut short: not what a restore of the part promises
            self.held[slot], self.base[slot] = [], 0
        tokens = list(tokens)
        n = common_prefix(self.target.tokens[slot], tokens)
        held = common_prefix(self.held[slot], tokens)
        if held >= n or n < 2 or n - held > self.catch_up:
            return min(held, n)
        rows = max(0, held - 1)
        cache = self._cache(slot, n - 1)
        self.block.forward(torch.tensor(tokens[rows + 1 : n]), self.target.get(slot, rows, n - 1), rows, cache)
        self.held[slot] = tokens[:n]
        return n

    def read_rows(self, slot: int, start: int, end: int) -> dict[str, torch.Tensor]:
        """Tokens [start, end) of the slot's state (draft_states.DraftRows): `kv` [1, 2, n, KVH, D] holds token
        t's layer row t-1 (token 0 has none: zeros), `hidden` [n, hidden] the target's row t."""
        kv = torch.zeros(1, 2, end - start, *self.block.kv_shape)
        lo = max(start, 1)
        if end > lo:
            k, v = self.caches[slot]
            kv[0, 0, lo - start :], kv[0, 1, lo - start :] = k[lo - 1 : end - 1], v[lo - 1 : end - 1]
        return {"kv": kv, "hidden": self.target.rows[slot][start:end].to(self.dtype, copy=True)}

    def forget(self, slot: int) -> None:
        """Its rows are about to be overwritten, or the slot's K/V was restored without them: the target's rows
        computed next start a context of their own (draft_states.DraftRows)."""
        self.held[slot], self.target.tokens[slot] = [], []
        self.base[slot] = self.target.first[slot] = 0

    def write_rows(self, slot: int, start: int, parts: dict[str, torch.Tensor]) -> None:
        """Restored rows (`read_rows`' layout) into the slot from token `start` on (draft_states.DraftRows)."""
        kv, hidden = parts["kv"], parts["hidden"]
        end = start + hidden.shape[0]
        lo = max(start, 1)
        if end > lo:
            k, v = self._cache(slot, end - 1)
            k[lo - 1 : end - 1], v[lo - 1 : end - 1] = kv[0, 0, lo - start :], kv[0, 1, lo - start :]
        self.target.put(slot, start, hidden)

    def restored(self, slot: int, tokens: Sequence[int]) -> None:
        """The slot's layer rows and target rows hold `tokens` (draft_states.DraftRows)."""
        self.held[slot], self.target.tokens[slot] = list(tokens), list(tokens)
        self.base[slot] = self.target.first[slot] = 0

    def restored_without(self, slot: int) -> None:
        """The target's rows of the restored tokens are not here (draft_states.DraftRows): the rows the target
        computes next start a context of the layer's own (`propose`)."""
        self.forget(slot)

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
