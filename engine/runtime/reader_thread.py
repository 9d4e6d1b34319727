"""A reader thread: one daemon thread running what is submitted, in order, each call's outcome in a Future.

Not a ThreadPoolExecutor: the interpreter joins an executor's workers at exit, so a read hung on a stalled disk
(a network share gone away), which the engine's shutdown gives up on, would keep the process alive until the
read returned. A daemon thread is left behind instead.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future


class ReaderThread:
    """Runs submitted calls one after another on a daemon thread (`name`)."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Future[None], Callable[..., object], tuple] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., object], *args: object) -> Future[None]:
        future: Future[None] = Future()
        self._queue.put((future, fn, args))
        return future

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                fn(*args)
            except BaseException as error:  # handed to whoever waits on the future, as an executor does
                future.set_exception(error)
            else:
                future.set_result(None)

    def shutdown(self, wait: bool, timeout: float | None = None) -> bool:
        """Stop after what is queued; `wait`: join the thread (up to `timeout` s), else cancel what has not begun
        and leave it. Returns whether the thread ended (a call still running past the timeout leaves it)."""
        if not wait:
            self._cancel_queued()
        self._queue.put(None)
        if wait:
            self._thread.join(timeout)
            if self._thread.is_alive():
                self._cancel_queued()
                self._queue.put(None)  # taken by the cancel: the thread ends once the hung call returns
        return not self._thread.is_alive()

    def join(self, timeout: float | None = None) -> bool:
        """Wait up to `timeout` s for the thread to end (after `shutdown`); whether it did."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _cancel_queued(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                item[0].cancel()
