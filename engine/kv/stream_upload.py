"""The incoming side of a restore into a slot whose K/V lives on a CUDA device, issued off the engine thread.

Through the engine's own pinned staging (engine/kv/pinned_staging.py) a restore's host->device copy runs on the
engine thread and on the main stream: an 11K-token conversation of an 8B model (1.44 GB) kept every other slot
waiting 47-53 ms on an H200 (docs/BENCHMARKS.md). Here the restore reader thread
(engine/runtime/pending_restores.py) copies the pieces into a staging ring of its own and issues the transfers
on a dedicated copy stream per device, then records one event per device after the last transfer and waits on
it itself (the GIL is released while it waits). The engine
thread meanwhile goes on stepping the other slots; it joins the restoring slot only once every event's
`query()` is true, and makes its main stream wait on those events before the slot's first step.

Ordering, both ways:
- before: the copy stream waits on an event recorded on the main stream when the restore began (`begin`), so
  no kernel still queued for the slot (its last step, a `clear`) can land after the restored rows;
- after: `join` makes the main stream wait on the copy events, so the slot's first step reads the restored rows.
Only the restoring slot's rows are written; no kernel the engine issues meanwhile reads or writes them (a
restoring slot is never stepped, parked or cleared). A staging buffer is reused only after the transfer out of
it finished (`PinnedStaging._take` waits on its event, on the reader thread).
"""

from __future__ import annotations

import threading

import torch

from engine.kv.buffers import KVBuffers
from engine.kv.pinned_staging import PinnedStaging


class StreamUploads:
    """The copy streams and staging rings for uploads into one `KVBuffers` (one upload at a time)."""

    def __init__(self, kv: KVBuffers) -> None:
        self.kv = kv
        self.devices = list(dict.fromkeys(s.device for s in kv.stages if s.device.type == "cuda"))
        assert self.devices, "stream uploads are for K/V with a stage on a CUDA device"
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._staging: dict[torch.device, PinnedStaging] = {}
        self.busy = threading.Lock()  # one upload uses the staging rings at a time

    @staticmethod
    def wanted(kv: KVBuffers) -> bool:
        """Whether restores into `kv` have a host->device copy worth taking off the engine thread."""
        return any(s.device.type == "cuda" for s in kv.stages)

    def begin(self, slot: int) -> SlotUpload:
        """Engine thread, when the restore starts: mark where the main streams are, for the copy to wait on."""
        self.kv.flush()  # rows the engine thread still gathers in its own staging go out first
        after: dict[torch.device, torch.cuda.Event] = {}
        for device in self.devices:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            after[device] = event
        return SlotUpload(self, slot, after)

    def parts(self, device: torch.device) -> tuple[torch.cuda.Stream, PinnedStaging]:
        if device not in self._streams:  # made on first use (on the reader): 128 MiB pinned per device
            self._streams[device] = torch.cuda.Stream(device)
            self._staging[device] = PinnedStaging(device)
        return self._streams[device], self._staging[device]


class SlotUpload:
    """One restore's copies into one slot: `write` for each piece and then `finish` (reader thread), then
    `landed` (polled) and `join` (engine thread)."""

    def __init__(self, owner: StreamUploads, slot: int, after: dict[torch.device, torch.cuda.Event]) -> None:
        assert 0 <= slot < owner.kv.n_slots, slot
        self.owner, self.slot, self._after = owner, slot, after
        self._done: dict[torch.device, torch.cuda.Event] = {}
        self._started = self._finishing = self.finished = self.joined = False

    def write(self, start: int, data: torch.Tensor) -> None:
        """Rows [start, start + n) of the slot <- host K/V in `KVBuffers.read`'s layout (reader thread): copied
        into staging now (`data` may change once this returns), sent on the copy streams."""
        assert not self._finishing, "write() after finish()"
        kv, slot = self.owner.kv, self.slot
        n = data.shape[2]
        assert start >= 0 and start + n <= kv.ctx, (slot, start, n)
        assert tuple(data.shape) == kv.layout.host_shape(n) and data.dtype == kv.layout.dtype
        if not self._started:
            self.owner.busy.acquire()  # released by finish(), which the reader always runs
            self._started = True
            for device, event in self._after.items():
                self.owner.parts(device)[0].wait_event(event)
        for stage in kv.stages:
            lo, hi = stage.first_layer, stage.end_layer
            if stage.device.type != "cuda":  # host rows of a slot nothing reads while it restores
                stage.k[:, slot, start : start + n].copy_(data[lo:hi, 0])
                stage.v[:, slot, start : start + n].copy_(data[lo:hi, 1])
            else:
                stream, staging = self.owner.parts(stage.device)
                with torch.cuda.device(stage.device), torch.cuda.stream(stream):
                    staging.queue(stage.k, slot, start, data[lo:hi, 0])
                    staging.queue(stage.v, slot, start, data[lo:hi, 1])
            stage.write_bytes += data[lo:hi].nbytes

    def finish(self) -> None:
        """Send what is gathered, record the copy events and wait for them (reader thread; also after a failed
        delivery: rows already sent must have landed before the engine clears the slot)."""
        assert not self._finishing, "finish() twice"
        self._finishing = True
        try:
            if self._started:
                for device in self.owner.devices:
                    stream, staging = self.owner.parts(device)
                    with torch.cuda.device(device), torch.cuda.stream(stream):
                        staging.flush()
                        event = torch.cuda.Event()
                        event.record(stream)
                    self._done[device] = event
                for event in self._done.values():
                    event.synchronize()  # the reader waits, so its wake-up comes once the rows are in place
        finally:
            if self._started:
                self.owner.busy.release()
            self.finished = True  # last: `landed` reads the events only once they are all recorded

    def landed(self) -> bool:
        """Whether every copy of this upload has finished on the device (engine thread; never blocks). A finish
        that failed half-way counts as landed: the restore then fails, and the engine clears the slot."""
        return self.finished and all(e.query() for e in self._done.values())

    def join(self) -> None:
        """Order the main streams after the copies, before the slot's first step (engine thread)."""
        assert self.landed() and not self.joined, "join() before the copies landed, or twice"
        for device, event in self._done.items():
            torch.cuda.current_stream(device).wait_event(event)
        self.joined = True
