"""Tensor bytes read from a model file straight onto a CUDA device through a small ring of pinned host buffers,
and the weights' hash computed on a thread of its own while the reading goes on.

Measured on an H100 host loading a 16 GB F16 GGUF (cProfile of Engine.from_config, docs/BENCHMARKS.md): reading
each tensor into a fresh pageable CPU tensor took 6.7 s (the kernel faulting in 16 GB of new pages), its
synchronous copy to the GPU 1.7 s more, and the xxh3 hash of every byte 1.7 s, one after the other. Here the file
is read in pieces into pinned buffers that stay mapped, each piece's copy to the device runs asynchronously and
its hash on the hashing thread while the next piece is read, and no host copy of a tensor outlives its pieces.
"""

from __future__ import annotations

import io
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import xxhash

PIECE_BYTES = 64 << 20
PIECES = 4
IN_FLIGHT = 4  # hashes queued behind the read at most (each holds its buffer alive until hashed)


class OrderedHash:
    """An xxh3-128 fed on one thread of its own, in the order of `add` (xxhash releases the GIL while it hashes,
    so the read goes on meanwhile); `digest` waits for every piece."""

    def __init__(self) -> None:
        self._hash = xxhash.xxh3_128()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="strata-hash")
        self._queued: deque[Future[None]] = deque()

    def add(self, data: Any) -> Future[None]:
        """Queue `data` (bytes or a buffer, left unchanged until the future is done) after what was queued."""
        while len(self._queued) >= IN_FLIGHT:
            self._queued.popleft().result()
        future = self._pool.submit(self._hash.update, data)
        self._queued.append(future)
        return future

    def digest(self) -> bytes:
        self._pool.shutdown(wait=True)
        for future in self._queued:
            future.result()  # a failure to hash is raised here
        return self._hash.digest()


class ReadStaging:
    """Reads into device memory for one CUDA device (created lazily: only a load onto CUDA pins anything)."""

    def __init__(self, device: torch.device) -> None:
        assert device.type == "cuda", device
        self.device = device
        self.buffers = [torch.empty(PIECE_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(PIECES)]
        self.events: list[torch.cuda.Event | None] = [None] * PIECES
        self.hashing: list[Future[None] | None] = [None] * PIECES
        self.next = 0

    def read(self, f: io.BufferedReader, offset: int, n: int,
             seen: Callable[[torch.Tensor], Future[None] | None]) -> torch.Tensor | None:
        """The `n` bytes at `offset` of `f` as a uint8 tensor on the device, each piece handed to `seen` (the
        weights' hash, which may go on after it returns, until its future is done) as it is read; None when the
        file ends before them."""
        out = torch.empty(n, dtype=torch.uint8, device=self.device)
        stream = torch.cuda.current_stream(self.device)
        f.seek(offset)
        done = 0
        while done < n:
            k = min(PIECE_BYTES, n - done)
            i = self.next
            self.next = (i + 1) % PIECES
            event, hashing = self.events[i], self.hashing[i]
            if event is not None:
                event.synchronize()  # the copy that used this buffer last is done
            if hashing is not None:
                hashing.result()  # and so is its hash
            piece = self.buffers[i][:k]
            # numpy's stubs give ndarray the buffer protocol only from Python 3.12 on; it has it on 3.11 too.
            if f.readinto(memoryview(piece.numpy())) != k:  # type: ignore[arg-type]
                return None
            self.hashing[i] = seen(piece)
            out[done:done + k].copy_(piece, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
            self.events[i] = event
            done += k
        return out

    def close(self) -> None:
        """Wait for the last copies and hashes (the buffers are freed with this object)."""
        for event, hashing in zip(self.events, self.hashing, strict=True):
            if event is not None:
                event.synchronize()
            if hashing is not None:
                hashing.result()
