"""Speculative decoding with a draft model (`--spec draft --model-draft PATH`): a smaller model of the target's
vocabulary proposes the next tokens greedily, and the target verifies them in its decode step exactly as it verifies
prompt-lookup drafts (engine/runtime/speculation.py, engine/runtime/scheduler.py `_verify`), so greedy output is the
target's own, token for token, whatever the draft proposes.

The draft keeps K/V of its own per slot (`DraftModel.kv`, a slot of the draft per slot of the target) and, per slot,
the tokens whose rows it holds (`held`). A draft first computes what the slot's sequence (prompt + generated) adds
to the longest prefix it holds, so a slot that goes on from its last turn, or from its last verify, re-reads
nothing; a slot that now holds another conversation (a restore, a new request) is re-read from where the two part.
Holding tokens rather than trusting the slot's history makes a stale or foreign draft state cost time, never a
different answer.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from engine.errors import ModelLoadError
from engine.kv import KVBuffers, KVLayout
from engine.runtime.model_runner import warm_up_steps
from engine.runtime.slot_set import common_prefix
from engine.runtime.speculation import SlotDrafter

if TYPE_CHECKING:
    from engine.model.build import LoadedModel
    from engine.model.tokenizer import Tokenizer

log = logging.getLogger("strata.engine")

# Tokens of the sequence the draft reads per decode step while it catches up (a new conversation's prompt): the
# step every slot waits on grows by one draft chunk at most, and the request decodes without drafts meanwhile.
CATCH_UP_CHUNK = 512
ROWS_MAX = 16  # up to this many tokens to catch up go as one-token rows (as a verify's), more as one chunk


def check_vocabulary(draft: Tokenizer, target: Tokenizer, draft_path: str, target_name: str) -> None:
    """ModelLoadError naming both models when the draft's tokenizer does not map every token text to the target's
    id (the draft's token ids are verified as the target's own, so they must mean the same text)."""
    if draft.fingerprint == target.fingerprint:
        return
    ours, theirs = draft.vocabulary(), target.vocabulary()
    if ours == theirs:
        return
    differs = sorted(set(ours.items()) ^ set(theirs.items()), key=lambda item: item[1])[0]
    text, token_id = differs
    in_draft = {v: k for k, v in ours.items()}.get(token_id)
    in_target = {v: k for k, v in theirs.items()}.get(token_id)
    raise ModelLoadError(
        f"--model-draft {draft_path}: its vocabulary ({len(ours)} tokens) is not that of the model {target_name} "
        f"({len(theirs)} tokens): token {token_id} is {in_draft!r} in the draft and {in_target!r} in the model "
        f"(first difference, at {text!r}); a draft model must share the model's tokenizer")


class DraftModel:
    """The draft model, its K/V per slot and the tokens each slot's rows hold (engine thread only)."""

    def __init__(self, loaded: LoadedModel, kv: KVBuffers, vocab: int) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.kv = kv
        self.vocab = vocab  # ids both models have: a draft token is fed to the model, whose embedding may be smaller
        self.catch_up = CATCH_UP_CHUNK
        self.held: list[list[int]] = [[] for _ in range(kv.n_slots)]
        self.reused: list[int] = [0] * kv.n_slots  # tokens the slot's last catch-up found held (its first draft's)

    @classmethod
    def load(cls, path: str, target: LoadedModel, n_slots: int, ctx: int, kv_dtype: torch.dtype,
             weights_format: str, *, device: str = "", cuda_graphs: bool = True) -> DraftModel:
        """Load the draft with K/V for `n_slots` slots of at most `ctx` tokens; ModelLoadError when it cannot draft
        for `target`. On `device` (--device-draft; "" = the target's first device) in the target's dtype and weights
        format; on a GPU in bfloat16 with graph-captured decode steps (`cuda_graphs`), whatever the target's: a
        draft's arithmetic changes which tokens are proposed, never the answer (the target verifies every one)."""
        from engine.model.graph_decode import configure
        from engine.model.hybrid import HybridCausalLM
        from engine.model.loader import load_model, read_model_config
        from engine.model.planning import parse_device

        where = torch.device(target.model.stages[0][0])
        if device:
            try:
                where = parse_device(device, "--device-draft")
            except ValueError as exc:
                raise ModelLoadError(str(exc)) from None
        dtype = target.dtype
        if where.type == "cuda":  # the CPU weight formats (int4, float16 rows) do not run there
            weights_format, dtype, kv_dtype = "float", torch.bfloat16, torch.bfloat16
        try:
            shape = read_model_config(path)
            loaded = load_model(path, [(where, 0, shape.n_layers)], dtype, int4_weights=weights_format == "int4")
        except ModelLoadError as exc:  # say which of the two models it was
            raise ModelLoadError(f"--model-draft: {exc}") from None
        if isinstance(loaded.model, HybridCausalLM):
            raise ModelLoadError(f"--model-draft {path}: a hybrid model's recurrent state cannot be rolled back to "
                                 "its last accepted token; a draft model must be an attention-only transformer")
        check_vocabulary(loaded.tokenizer, target.tokenizer, path, target.name)
        if weights_format == "float16":
            from engine.model import float16

            float16.pack_model(loaded.model)
        loaded.weights_format = weights_format
        cfg = loaded.config
        ctx = min(ctx, cfg.max_position_embeddings or ctx)
        kv = KVBuffers(KVLayout(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, kv_dtype), n_slots, ctx,
                       [(where, 0, cfg.n_layers)])
        # Decoded as fast as the device allows: no row-invariance is needed of a draft (see above).
        log.info("draft model %s: %d layers on %s (%s weights); %s", loaded.name, cfg.n_layers, where,
                 weights_format, configure(loaded.model, n_slots, cuda_graphs=cuda_graphs, deterministic=False))
        return cls(loaded, kv, min(cfg.vocab_size, target.config.vocab_size))

    def warm_up(self) -> None:
        """One short prefill and a decode step of each captured batch size, as the model's own warm-up
        (ModelRunner.warm_up): a draft on a GPU captures its first graphs now, not in the first request that
        drafts, and holds their memory before the verify step's budget is measured. The slots are left empty
        (a context of one token has no warm-up, and never drafts either: `propose`)."""
        with torch.inference_mode():
            for chunks in warm_up_steps(self.kv.ctx, self.kv.n_slots, self.model.warm_up_batches()):
                self.model.forward_chunks(chunks, self.kv)
        for i in range(self.kv.n_slots):
            self.kv.clear(i)
            self.held[i] = []

    def parkable(self, slot: int, tokens: Sequence[int]) -> int:
        """The prefix of `tokens` whose rows the slot holds (draft_states.DraftRows)."""
        return common_prefix(self.held[slot], list(tokens))

    def read_rows(self, slot: int, start: int, end: int) -> dict[str, torch.Tensor]:
        """The slot's K/V of tokens [start, end), the one part a draft model parks (draft_states.DraftRows)."""
        return {"kv": self.kv.read(slot, start, end)}

    def forget(self, slot: int) -> None:
        """Its rows are about to be overwritten (draft_states.DraftRows)."""
        self.held[slot] = []

    def write_rows(self, slot: int, start: int, parts: dict[str, torch.Tensor]) -> None:
        """Restored K/V into the slot from token `start` on (draft_states.DraftRows)."""
        self.kv.write(slot, start, parts["kv"])

    def restored(self, slot: int, tokens: Sequence[int]) -> None:
        """The slot's rows hold `tokens` (draft_states.DraftRows)."""
        self.held[slot] = list(tokens)

    def restored_without(self, slot: int) -> None:
        """Its rows stay (draft_states.DraftRows): keyed by the tokens they hold, what they share with the
        restored conversation is still good, and the rest is read again."""

    def drafter(self, slot: int, prompt: list[int], draft_max: int) -> SlotDrafter:
        """A request's drafter in `slot` (speculation.DraftSource)."""
        return SlotDrafter(self, slot, prompt, draft_max)

    def propose(self, slot: int, sequence: list[int], k: int) -> list[int]:
        """The draft's `k` greedy tokens after `sequence` in `slot`, fewer where the draft's context ends; none
        while more than `catch_up` tokens of `sequence` are still to read (one chunk of them is read per call)."""
        k = min(k, self.kv.ctx - len(sequence) + 1)  # the last proposed token is never fed: it needs no row
        if k <= 0 or not sequence:
            return []
        from engine.model.llama import SeqChunk

        held = self.held[slot]
        start = min(common_prefix(held, sequence), len(sequence) - 1)  # the last token's logits are needed
        self.reused[slot] = start
        self.held[slot] = held = sequence[:start]  # the rows past `start` are about to be overwritten
        if len(sequence) - start > self.catch_up:  # a long way behind: one chunk now, drafts once caught up
            end = start + self.catch_up
            self.model.forward_chunks([SeqChunk(slot, start, torch.tensor(sequence[start:end]))], self.kv)
            held.extend(sequence[start:end])
            return []
        rest = sequence[start:]
        if len(rest) <= ROWS_MAX:  # the last verify's few tokens: one-token rows take the decode step's fast path
            chunks = [SeqChunk(slot, start + j, torch.tensor([t])) for j, t in enumerate(rest)]
        else:
            chunks = [SeqChunk(slot, start, torch.tensor(rest))]
        logits = self.model.forward_chunks(chunks, self.kv)
        held.extend(rest)
        out = [int(torch.argmax(logits[len(chunks) - 1][:self.vocab]))]
        while len(out) < k:
            logits = self.model.forward_chunks([SeqChunk(slot, len(held), torch.tensor(out[-1:]))], self.kv)
            held.append(out[-1])
            out.append(int(torch.argmax(logits[0][:self.vocab])))
        return out
