"""A small ring of pinned host buffers that moves K/V between pageable host memory and a CUDA device fast.

Copies between pageable memory and a GPU go through the driver's own bounce buffer, one synchronous piece at a
time (about 2 GB/s measured on an H200 host for block-sized pieces). Through pinned buffers they run
asynchronously, and the CPU copy into buffer i+1 overlaps the transfer out of buffer i.
Parked blocks themselves stay in ordinary memory: pinned allocations are rounded up to powers of two, which
would break the cache's byte budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

STAGING_BUFFER_BYTES = 32 << 20
STAGING_BUFFERS = 4


@dataclass(slots=True)
class _Upload:
    """Consecutive token rows of one slot gathered in one staging buffer, token-major, not yet sent."""

    full: torch.Tensor  # the device K or V of a stage, [layers, n_slots, ctx, ...]
    slot: int
    start: int
    end: int
    index: int  # the ring buffer
    capacity: int  # tokens the buffer holds at this row size


class PinnedStaging:
    """Round-robin pinned buffers with one CUDA event each, for one device.

    Restores arrive a block (64 tokens) at a time: one transfer per block ran at ~20 GB/s on the H200 host,
    512-token pieces at ~36 GB/s (per-transfer costs: a device temporary, a copy kernel, an event). So `queue`
    gathers consecutive rows of a slot into a buffer and sends the buffer when it is full, when the next rows
    are not consecutive, or on `flush`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffers = [torch.empty(STAGING_BUFFER_BYTES, dtype=torch.uint8, pin_memory=True)
                        for _ in range(STAGING_BUFFERS)]
        self.events: list[torch.cuda.Event | None] = [None] * STAGING_BUFFERS
        self.next = 0
        self._open: dict[int, _Upload] = {}  # by id() of the device tensor written

    @property
    def pending(self) -> bool:
        return bool(self._open)

    def _take(self) -> tuple[int, torch.Tensor]:
        if len(self._open) == STAGING_BUFFERS:  # more K/V tensors gathering than buffers (several stages)
            self._send(next(iter(self._open.values())))
        held = {u.index for u in self._open.values()}
        while self.next in held:
            self.next = (self.next + 1) % STAGING_BUFFERS
        i = self.next
        self.next = (i + 1) % STAGING_BUFFERS
        event = self.events[i]
        if event is not None:
            event.synchronize()  # the transfer that used this buffer last is done
        return i, self.buffers[i]

    def _chunks(self, n_layers: int, n_tokens: int, row_bytes: int) -> list[tuple[int, int]]:
        """Token ranges whose [n_layers, tokens, ...] piece fits one buffer."""
        per = max(1, STAGING_BUFFER_BYTES // max(1, n_layers * row_bytes))
        return [(t, min(n_tokens, t + per)) for t in range(0, n_tokens, per)]

    def queue(self, full: torch.Tensor, slot: int, start: int, src: torch.Tensor) -> None:
        """full[:, slot, start + t] <- src[:, t] for a host src [layers, tokens, ...]: copied into staging now
        (src may change once this returns), sent to the device later (`flush`)."""
        layers, n = src.shape[0], src.shape[1]
        row = src[0, 0].nbytes
        capacity = max(1, STAGING_BUFFER_BYTES // max(1, layers * row))
        done = 0
        while done < n:
            up = self._open.get(id(full))
            if up is None or up.slot != slot or up.end != start + done or up.end - up.start == up.capacity:
                if up is not None:
                    self._send(up)
                i, _ = self._take()
                up = _Upload(full, slot, start + done, start + done, i, capacity)
                self._open[id(full)] = up
            take = min(n - done, up.capacity - (up.end - up.start))
            offset = (up.end - up.start) * layers * row
            region = self.buffers[up.index][offset : offset + take * layers * row]
            region.view(src.dtype).view(take, layers, *src.shape[2:]).copy_(src[:, done : done + take].transpose(0, 1))
            up.end += take
            done += take

    def _send(self, up: _Upload) -> None:
        del self._open[id(up.full)]
        n, layers = up.end - up.start, up.full.shape[0]
        shape = (n, layers, *up.full.shape[3:])
        staged = self.buffers[up.index][: n * layers * up.full[0, 0, 0].nbytes].view(up.full.dtype).view(shape)
        with torch.cuda.device(self.device):
            up.full[:, up.slot, up.start : up.end].transpose(0, 1).copy_(staged, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        self.events[up.index] = event

    def flush(self) -> None:
        """Send every gathered upload (queued on the current stream: later kernels see the rows)."""
        for up in list(self._open.values()):
            self._send(up)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst <- src for a host dst [layers, tokens, ...] and a device src of the same shape (synchronous)."""
        if src.numel() == 0:
            return
        self.flush()
        row_bytes = src[0, 0].nbytes
        with torch.cuda.device(self.device):
            stream = torch.cuda.current_stream(self.device)
            pending: list[tuple[torch.Tensor, torch.Tensor, torch.cuda.Event]] = []
            for a, b in self._chunks(src.shape[0], src.shape[1], row_bytes):
                _, buf = self._take()
                piece = src[:, a:b]
                staged = buf[: piece.nbytes].view(src.dtype).view(piece.shape)
                staged.copy_(piece, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
                pending.append((dst[:, a:b], staged, event))
                if len(pending) == STAGING_BUFFERS - 1:
                    self._drain(pending)
            self._drain(pending)

    @staticmethod
    def _drain(pending: list) -> None:
        for out, staged, event in pending:
            event.synchronize()
            out.copy_(staged)
        pending.clear()

    def synchronize(self) -> None:
        self.flush()
        torch.cuda.synchronize(self.device)
