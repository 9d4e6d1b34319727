"""The engine thread's loop: the inbox, admission (slot choice, cache lookup, park and restore), one forward
step over every active slot, emitting tokens, finishing requests, and the shutdown."""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from engine.cache.attrs import DEFAULT_PRIORITY
from engine.cache.explain import LookupReport
from engine.config import EngineConfig
from engine.contract import RequestRecord
from engine.model import moe_offload
from engine.runtime.control import CacheControl
from engine.runtime.draft_states import DraftStates
from engine.runtime.explain import Admission, Candidate, explain
from engine.runtime.model_runner import ModelRunner
from engine.runtime.parking import Parking
from engine.runtime.pending_restores import Looked, PendingRestores
from engine.runtime.requests import GenerationRequest, TokenEvent, Usage
from engine.runtime.sampling import Sampler
from engine.runtime.slot_choice import MIN_PARK_TOKENS, cheapest, choose_slot
from engine.runtime.slot_set import SlotSet
from engine.runtime.speculation import Speculation
from engine.runtime.state import Active, Slot
from engine.runtime.stats import EngineStats
from engine.runtime.stop_strings import StopStringFilter
from engine.runtime.stream import RequestStream

if TYPE_CHECKING:
    from engine.runtime.protocols import Tokenizer

log = logging.getLogger("strata.engine")
CANCELLED = "the request was cancelled: its client left or stopped reading its stream"

# What the engine thread's inbox carries: ("submit", (request, stream)), ("call", (fn, future)), ("wake", None).
Inbox = queue.SimpleQueue[tuple[str, Any]]


class Scheduler:
    """Continuous batching over the slots; everything but `stop` and `queued` runs only on the engine thread
    (`loop`), which takes its work from `inbox`."""

    def __init__(self, slots: SlotSet, runner: ModelRunner, control: CacheControl, restores: PendingRestores,
                 stats: EngineStats, tokenizer: Tokenizer, inbox: Inbox, speculation: Speculation,
                 draft_states: DraftStates | None = None) -> None:
        self.slots = slots
        self.speculation = speculation
        self.runner = runner
        self.control = control
        self.restores = restores
        self.draft_states = draft_states
        self.parking = Parking(slots, control, restores, stats, draft_states)
        self.stats = stats
        self.tokenizer = tokenizer
        self.inbox = inbox
        self._waiting: list[tuple[GenerationRequest, RequestStream]] = []
        self._stop = threading.Event()
        # At the default --prefill-chunk, a model that brings experts from host RAM to its GPU for long batches
        # prefills longer chunks (engine/model/moe_offload.py, PREFILL_CHUNK, says why).
        self._offload_chunk = moe_offload.PREFILL_CHUNK if moe_offload.offloads(runner.model.layers) else 0

    @property
    def queued(self) -> int:
        """Requests waiting for a slot (any thread: a length read)."""
        return len(self._waiting)

    def stop(self) -> None:
        """End the loop after its current step (any thread)."""
        self._stop.set()
        self.inbox.put(("wake", None))

    def loop(self) -> None:
        with torch.inference_mode():
            while not self._stop.is_set():
                idle = not self._waiting and not self.slots.any_active()
                self._drain_inbox(block=idle)  # a finished background read wakes it ("wake")
                if self._stop.is_set():
                    break
                for slot, looked, reused, failed, read in self.parking.delivered():
                    try:
                        self._start_restored(slot, looked, reused, failed, read)  # it joins the batch
                    except Exception as exc:  # as _admit_waiting: that request fails, the engine serves on
                        log.exception("could not start request %s", looked.request.request_id)
                        slot.active = None
                        self.slots.forget(slot)
                        looked.stream.put(TokenEvent(finish_reason="error", error=f"internal error: {exc}",
                                                     usage=Usage(len(looked.request.prompt_tokens), 0, 0)))
                self._drop_cancelled()
                self._admit_waiting()
                if self.slots.any_active():
                    try:
                        self._step()
                    except Exception as exc:  # a bug must not hang clients: fail their requests, keep serving
                        log.exception("engine step failed")
                        self._fail_active(f"internal error: {exc}")
                if self.stats.due():
                    self.stats.publish()

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload = item
            if kind == "submit":
                self._waiting.append(payload)
            elif kind == "call":
                fn, future = payload
                if future.set_running_or_notify_cancel():
                    try:
                        result = fn()
                    except BaseException as exc:  # noqa: BLE001 - handed to the caller
                        self.stats.publish()
                        future.set_exception(exc)
                    else:
                        self.stats.publish()  # before the caller hears back, so its next stats read sees the change
                        future.set_result(result)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _drop_cancelled(self) -> None:
        kept = []
        for request, stream in self._waiting:
            if stream.cancelled.is_set():
                stream.put(TokenEvent(finish_reason="error", error=CANCELLED, usage=Usage(len(request.prompt_tokens), 0, 0)))
            else:
                kept.append((request, stream))
        self._waiting = kept
        for slot in self.slots.slots:
            if slot.active is not None and slot.active.stream.cancelled.is_set():
                log.info("request %s cancelled by the client; slot %d freed", slot.active.request.request_id, slot.id)
                self._finish(slot, "error", CANCELLED)

    def _fail_active(self, message: str) -> None:
        for slot in self.slots.slots:
            if slot.active is not None:
                a = slot.active
                a.stream.put(TokenEvent(finish_reason="error", error=message,
                                        usage=Usage(len(a.request.prompt_tokens), len(a.generated), a.cached_tokens)))
                slot.active = None
                # What the failed step wrote is unknown: forget the slot's contents.
                self.slots.forget(slot)

    # ------------------------------------------------------------------ admission: slot choice + cache

    def _admit_waiting(self) -> None:
        admitted = False
        while self._waiting:
            free = self.slots.free()
            if not free:
                break
            request, stream = self._waiting.pop(0)
            admitted = True
            try:
                self._admit(request, stream, free)
            except Exception as exc:
                log.exception("could not start request %s", request.request_id)
                stream.put(TokenEvent(finish_reason="error", error=f"internal error: {exc}",
                                      usage=Usage(len(request.prompt_tokens), 0, 0)))
        if admitted:  # the next step may be long: show the busy slots and restores before it
            self.stats.publish()

    def _admit(self, request: GenerationRequest, stream: RequestStream, free: list[Slot]) -> None:
        prompt = request.prompt_tokens
        usable = len(prompt) - 1  # the last prompt token is always computed: its logits pick the first output
        # The slot it would continue or displace (slot_choice), and what of the prompt that slot holds.
        live = {s.id: self.slots.live_reuse(s, prompt, usable) for s in free}  # a hybrid: up to a checkpoint
        cache = self.control.cache
        slot = choose_slot(free, live, len(prompt), self.control.config.side_call_tokens)
        best = max(free, key=lambda s: (live[s.id], -s.last_used))  # the live slot sharing most (for the record)
        hit = None
        report = LookupReport()
        small_gain = False
        if cache is not None:
            hit, report = cache.explain_lookup(prompt, live_prefix=live[slot.id])
            if hit is not None and hit.n_tokens - live[slot.id] < MIN_PARK_TOKENS:
                hit, small_gain = None, True
            if hit is None and live[slot.id] < usable:
                cache.record_miss()
        candidate = Candidate(f"slot {best.id}", live[best.id], best.tokens) if best.tokens else None
        if hit is not None:
            # Restore into the slot whose loss is cheapest, parking what it holds.
            slot = cheapest(free)
            looked = Looked(request, stream, hit, candidate, report, small_gain)
            # A read from files or the remote store, or a copy onto a GPU: off this thread (Parking.delivered).
            if hit.tier != "ram" or self.restores.all_off_thread:
                failed = self.parking.read_in_background(slot, looked)
                if failed is not None:  # the hit failed its checks: a clean miss, started at once
                    self._start_restored(slot, looked, 0, failed)
            else:  # RAM into host slots: a memcpy, here
                reused, failed = self.parking.restore(slot, hit, prompt)
                self._start_restored(slot, looked, reused, failed)
        else:
            reused = live[slot.id]
            self.parking.park_if_losing(slot, reused)
            if not (reused and reused == len(slot.tokens)):  # not going on from all of it: another conversation
                slot.conversation_id, slot.unnamed = None, []
            self.slots.keep(slot, reused)
            if not reused:
                slot.priority, slot.pinned = DEFAULT_PRIORITY, False
            source = "live" if reused else "none"
            self._start(request, stream, slot, Admission(prompt, reused, source, candidate, report, small_gain,
                                                             rewritten_at=request.rewritten_at))

    def _start_restored(self, slot: Slot, looked: Looked, reused: int, failed: str,
                        read: dict[str, Any] | None = None) -> None:
        """Start a request whose hit was restored (`reused` tokens) or failed to (0, `failed`: a clean miss)."""
        request, stream, hit, candidate, report, small_gain = looked
        slot.priority, slot.pinned = (hit.priority, hit.pinned) if reused else (DEFAULT_PRIORITY, False)
        # The request continues the parked conversation if it goes on from all of it (else it is a branch).
        continues = reused > 0 and reused >= report.candidate_tokens
        slot.conversation_id, slot.unnamed = (hit.conversation_id if continues else None), []
        source = hit.tier if reused else "none"
        adm = Admission(request.prompt_tokens, reused, source, candidate, report, small_gain, failed,
                        request.rewritten_at)
        self._start(request, stream, slot, adm, read)

    def _start(self, request: GenerationRequest, stream: RequestStream, slot: Slot, adm: Admission,
               read: dict[str, Any] | None = None) -> None:
        """The admitted request takes `slot`, which holds its first `adm.reused` tokens."""
        assert not slot.restoring and slot.active is None, slot.id
        prompt, reused, attrs = request.prompt_tokens, adm.reused, request.attrs
        slot.attrs = attrs
        slot.priority = attrs.priority or slot.priority
        slot.pinned = slot.pinned if attrs.pinned is None else attrs.pinned
        self._record(request, slot, adm, read)

        max_tokens = request.params.max_tokens or (self.slots.ctx_size - len(prompt))
        slot.prompt = list(prompt)
        slot.active = Active(
            request=request,
            stream=stream,
            sampler=Sampler(request.params, prompt),
            stops=StopStringFilter(request.params.stop),
            decoder=self.tokenizer.stream_decoder(),
            cached_tokens=reused,
            max_tokens=max_tokens,
            drafter=self.speculation.drafter(prompt, slot.id),
        )
        slot.last_used = time.time()
        stream.mark_started()
        self.stats.counters["requests"] += 1
        self.stats.counters["prompt_tokens"] += len(prompt)
        self.stats.counters["cached_tokens"] += reused

    def _record(self, request: GenerationRequest, slot: Slot, adm: Admission, read: dict[str, Any] | None) -> None:
        """Explain the admitted request and log it under the slot's conversation (never fails the request);
        `read`: how its restore's background read went (detail `restore_read`)."""
        conversation_id = slot.conversation_id
        try:
            reason, detail = explain(adm, self.tokenizer.decode)
        except Exception:  # an explanation must never take a request down
            log.exception("explaining request %s failed", request.request_id)
            reason, detail = "cold", {"error": "no explanation: see the engine log"}
        if read is not None:
            detail = {**detail, "restore_read": read}
        # Name and client travel on the request (metadata / X-Strata-* headers); the priority is the slot's
        # resolved one (a request that leaves it unset keeps the conversation's).
        attrs = request.attrs
        self.stats.requests.add(RequestRecord(
            time=time.time(), request_id=request.request_id, conversation_id=conversation_id,
            name=attrs.name, client=attrs.client, priority=slot.priority,
            prompt_tokens=len(adm.prompt), reused_tokens=adm.reused, source=adm.source, reason=reason,
            detail=detail, past_reasoning=request.past_reasoning,
        ))
        if conversation_id is None:
            slot.unnamed.append(request.request_id)  # named when the slot's conversation is first parked

    # ------------------------------------------------------------------ one forward step

    def _prefill_chunk(self) -> int:
        chunk = self.control.config.prefill_chunk
        return max(chunk, self._offload_chunk) if chunk == _DEFAULT_PREFILL_CHUNK else chunk

    def _step(self) -> None:
        from engine.model.llama import SeqChunk

        began = time.perf_counter()  # a draft model's or next-token layer's proposals are part of a decode step
        chunks: list[SeqChunk] = []
        owners: list[tuple[Slot, int, bool]] = []  # (slot, its first chunk, produces a token this step)
        n_prefill = n_decode = 0
        active = [slot for slot in self.slots.slots if slot.active is not None]
        decoding = [slot for slot in active if slot.active is not None and slot.active.next_token is not None]
        # where the model limits a step's rows per slot (a CUDA model's captured step: graph_verify.py)
        limits = self.runner.verify_rows([len(slot.tokens) for slot in decoding], len(decoding) < len(active))
        rows = dict(zip((slot.id for slot in decoding), limits, strict=True)) if limits is not None else {}
        for slot in active:
            a = slot.active
            assert a is not None
            assert not slot.restoring, f"slot {slot.id} is restoring and must not be stepped"
            pos = len(slot.tokens)
            if a.next_token is not None:  # decoding: feed the last sampled token, and a draft's tokens after it
                owners.append((slot, len(chunks), True))
                # a draft never reaches past the context, nor past what max_tokens leaves after the target's token
                room = min(self.slots.ctx_size - 2 - pos, a.max_tokens - len(a.generated) - 1,
                           rows.get(slot.id, self.slots.ctx_size) - 1)
                fed = [a.next_token, *(a.drafter.draft(a.generated, room) if a.drafter and room > 0 else [])]
                self.slots.memory.before_step(slot.id, pos, pos + len(fed), len(slot.prompt))
                # one-token rows: each computes what decoding its token alone computes (llama.check_rows)
                chunks += [SeqChunk(slot.id, pos + j, torch.tensor([t], dtype=torch.int64)) for j, t in enumerate(fed)]
                n_decode += len(fed)
            else:  # prefilling the prompt, one chunk per step
                end = _prefill_end(pos, len(slot.prompt), self._prefill_chunk())
                owners.append((slot, len(chunks), end == len(slot.prompt)))
                self.slots.memory.before_step(slot.id, pos, end, len(slot.prompt))
                chunks.append(SeqChunk(slot.id, pos, torch.tensor(slot.prompt[pos:end], dtype=torch.int64)))
                n_prefill += end - pos
        t0 = time.perf_counter()
        logits = self.runner.forward(chunks)
        dt = time.perf_counter() - t0
        for slot, _, _ in owners:
            self.slots.memory.after_step(slot.id, len(slot.prompt))
        if n_prefill:  # a prefill or a mixed step (the latter counts for neither rate)
            self.stats.note_rates(n_prefill, n_decode, dt)
            if self.control.cache is not None and self.stats.prefill_rate is not None:
                self.control.cache.prefill_tokens_per_s = self.stats.prefill_rate  # the restore-or-prefill cost model
        generated = self.stats.counters["generated_tokens"]
        for k, (slot, first, produces) in enumerate(owners):
            end = owners[k + 1][1] if k + 1 < len(owners) else len(chunks)
            if end - first > 1:  # a decode row and its draft's
                self._verify(slot, [int(ch.tokens[0]) for ch in chunks[first:end]], logits[first:end])
                continue
            a = slot.active
            assert a is not None
            slot.tokens.extend(chunks[first].tokens.tolist())
            if produces and (ended := self._emit(slot, a.sampler.sample(logits[first]))):
                self._finish(slot, ended)
        if not n_prefill:  # the decode rate in tokens emitted: a draft's accepted tokens count, its rejected rows not
            self.stats.note_rates(0, self.stats.counters["generated_tokens"] - generated, t0 + dt - began)
            # what a row costs this step: prompt lookup's break-even (one row per decoding slot, the rest drafts)
            self.speculation.costs.note(n_decode, dt, slots=len(owners))

    def _verify(self, slot: Slot, fed: list[int], logits: torch.Tensor) -> None:
        """Emit the target's tokens for the rows `fed` (the decoded token, then the draft) one at a time, as
        decoding them one per step would, while each is the draft's next token; the slot then holds the tokens
        whose rows were kept (the memory rewound past the rejected ones).

        A token that ends the request (the end of a sequence, a stop string, max_tokens) ends the rows there, and
        the request is finished only once the verify's figures are recorded: `_finish` reports them."""
        a = slot.active
        assert a is not None and a.drafter is not None
        accepted, ended = 0, None
        for j, token in enumerate(fed):
            slot.tokens.append(token)
            # a drafted row's choice keeps the draft or replaces it (rejection sampling when sampled); the last
            # row's is the target's own next token
            choice = a.sampler.verify(logits[j], fed[j + 1]) if j + 1 < len(fed) else a.sampler.sample(logits[j])
            ended = self._emit(slot, choice)
            agrees = j + 1 < len(fed) and choice == fed[j + 1]
            accepted += agrees  # the row that ends the request counts when it agrees: the target chose the draft
            if ended or not agrees:
                break
        a.drafter.record(len(fed) - 1, accepted)
        self.stats.counters["spec_drafted_tokens"] += len(fed) - 1
        self.stats.counters["spec_accepted_tokens"] += accepted
        self.slots.keep(slot, len(slot.tokens))  # the rejected rows' K/V is overwritten by the next step
        if ended:
            self._finish(slot, ended)

    def _emit(self, slot: Slot, token: int) -> str | None:
        """Hand `token` to the request; the finish reason when it ends it ("stop", "length"), which the caller
        passes to `_finish`, else None."""
        a = slot.active
        assert a is not None
        a.generated.append(token)
        self.stats.counters["generated_tokens"] += 1
        if len(a.generated) == 1:
            self.stats.requests.first_token(a.request.request_id, a.stream.submitted)
        if token in self.tokenizer.eos_token_ids and not a.request.params.ignore_eos:
            return "stop"
        text = a.stops.push(a.decoder.push(token))
        if a.stops.stopped:
            if text:
                a.stream.put(TokenEvent(text=text, token_id=token))
            a.next_token = token
            return "stop"
        a.stream.put(TokenEvent(text=text, token_id=token))
        a.next_token = token
        if len(a.generated) >= a.max_tokens or len(slot.tokens) + 1 >= self.slots.ctx_size:
            return "length"
        return None

    def _finish(self, slot: Slot, reason: str, error: str = "") -> None:
        """End the slot's request: `reason` "stop" or "length" for an answer that ended, "error" (with `error`) for
        one the engine cut (a cancel, the shutdown), which the APIs report as a failure, not as an answer."""
        a = slot.active
        assert a is not None and (reason == "error") == bool(error), (reason, error)
        tail = "" if a.stops.stopped else a.stops.push(a.decoder.flush()) + a.stops.flush()
        usage = Usage(len(a.request.prompt_tokens), len(a.generated), a.cached_tokens)
        if a.drafter is not None:
            a.drafter.finish(a.generated)
            if a.drafter.drafted:
                self.stats.requests.speculated(a.request.request_id, a.drafter.drafted, a.drafter.accepted,
                                               a.drafter.reused)
        slot.active = None
        slot.last_used = time.time()
        self.stats.publish()  # before the client hears the end, so its next stats read counts this request
        a.stream.put(TokenEvent(text=tail, finish_reason=reason, error=error or None, usage=usage,
                                stop_string=a.stops.matched,
                                generated=list(a.generated)))

    # ------------------------------------------------------------------ shutdown

    def shutdown(self, deadline_s: float) -> None:
        """End every request, park the live slots worth keeping (tiered/disk) and close the cache (engine thread)."""
        for p in self.restores.close(timeout=deadline_s / 2):  # read, never delivered: the slot stays empty
            p.slot.restoring = False
            p.context.stream.put(TokenEvent(finish_reason="error", error="the engine is shutting down",
                                            usage=Usage(len(p.context.request.prompt_tokens), 0, 0)))
        for slot in self.slots.slots:
            if slot.active is not None:
                self._finish(slot, "error", "the engine is shutting down: the answer was cut")
        for request, stream in self._waiting:
            stream.put(TokenEvent(finish_reason="error", error="the engine is shutting down",
                                  usage=Usage(len(request.prompt_tokens), 0, 0)))
        self._waiting = []
        cache = self.control.cache
        if cache is None:
            return
        keeps = self.control.config.conversation_cache_storage in ("tiered", "disk")
        if keeps:
            for slot in self.slots.slots:
                if len(slot.tokens) >= MIN_PARK_TOKENS:
                    self.parking.park(slot)
        cache.close(spill=keeps, deadline_s=deadline_s)
        if self.draft_states is not None:
            self.draft_states.close(spill=keeps, deadline_s=deadline_s)


_DEFAULT_PREFILL_CHUNK = next(f.default for f in dataclasses.fields(EngineConfig) if f.name == "prefill_chunk")


def _prefill_end(pos: int, n_prompt: int, chunk: int) -> int:
    """End of the next prefill chunk from `pos`: at most `chunk` tokens, and the prompt's last token alone.

    A token's K/V and logits depend in their last bits on the chunk that computes it (attention kernels tile
    by sequence length; a lone token takes another path than a row of a chunk). A prompt whose K/V is all
    present again (a conversation restored after a restart, the same turn asked again, a slot that kept it)
    recomputes only its last token, alone. Computing that token alone the first time too makes the logits
    that pick the first output, and so a greedy continuation, identical whichever way the rest was chunked.
    """
    assert 0 <= pos < n_prompt and chunk > 0, (pos, n_prompt, chunk)
    last = n_prompt - 1
    if pos == last:
        return n_prompt
    return min(last, pos + chunk)
