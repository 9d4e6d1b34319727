"""The per-request channel from the engine thread to whoever waits on the tokens (async server or sync tool)."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time

from engine.runtime.requests import TokenEvent

log = logging.getLogger("strata.engine")
# A consumer this many events behind has stopped reading (a client that no longer reads its stream, whose socket
# buffers are full): its request is cancelled rather than generated on into memory. ~40 s at 100 tokens/s.
MAX_UNREAD = 4096


class RequestStream:
    """Events of one request, in order. Iterate with `async for` (server) or `for` (tools, tests).

    The engine thread calls `put`; the consumer iterates until an event with a finish_reason. `cancel()`
    tells the engine to stop the request and free its slot (a client that went away).
    """

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.submitted = time.monotonic()  # when the engine got it: time to first token counts from here
        self.cancelled = threading.Event()
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._async_queue: asyncio.Queue[TokenEvent] | None = asyncio.Queue() if self._loop else None
        self._sync_queue: queue.SimpleQueue[TokenEvent] = queue.SimpleQueue()
        self._done = False
        # Set when the request leaves the queue: a slot took it, or the engine ended it before that.
        self.started = threading.Event()
        self._started_async = asyncio.Event() if self._loop else None

    # -- engine side
    def mark_started(self) -> None:
        """The request left the queue (engine thread)."""
        self.started.set()
        if self._loop is not None and self._started_async is not None:
            try:
                self._loop.call_soon_threadsafe(self._started_async.set)
            except RuntimeError:  # the consumer's loop is gone
                self.cancelled.set()

    def put(self, event: TokenEvent) -> None:
        if not self.started.is_set():
            self.mark_started()
        if (self._async_queue is not None and self._async_queue.qsize() > MAX_UNREAD
                and event.finish_reason is None and not self.cancelled.is_set()):
            log.warning("request %s: its client has not read %d events: it stopped reading, request cancelled",
                        self.request_id, self._async_queue.qsize())
            self.cancelled.set()
        if self._loop is not None and self._async_queue is not None:
            try:
                self._loop.call_soon_threadsafe(self._async_queue.put_nowait, event)
            except RuntimeError:  # the consumer's loop is gone: nobody is listening any more
                self.cancelled.set()
        else:
            self._sync_queue.put(event)

    # -- consumer side
    def cancel(self) -> None:
        self.cancelled.set()

    async def wait_started(self, timeout: float) -> bool:
        """Wait up to `timeout` s for the request to leave the queue; False if it is still waiting."""
        assert self._started_async is not None, "this stream was created outside an event loop"
        try:
            await asyncio.wait_for(self._started_async.wait(), timeout)
        except TimeoutError:
            return self.started.is_set()
        return True

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenEvent:
        if self._done:
            raise StopAsyncIteration
        assert self._async_queue is not None, "this stream was created outside an event loop; iterate with `for`"
        event = await self._async_queue.get()
        if event.finish_reason is not None:
            self._done = True
        return event

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> TokenEvent:
        if self._done:
            raise StopIteration
        event = self._sync_queue.get()
        if event.finish_reason is not None:
            self._done = True
        return event
