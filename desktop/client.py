"""Talking to the engine without blocking the UI: HTTP and psutil run on worker threads, results come back as signals.

`Dispatcher` is the one helper that runs a callable on a worker thread and hands its result (or exception) to a
callback on the GUI thread. `EngineClient` issues the engine's HTTP calls through it. `Poller` fetches
`/metrics`, `/cache/conversations`, `/cache/events` and `/cache/requests` and samples memory with psutil on a timer, never
starting a fetch while the previous one of the same kind is still in flight, so a slow engine cannot pile up
requests.
"""

from __future__ import annotations

import threading
import time
import urllib.parse
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import psutil
from PySide6.QtCore import QObject, QTimer, Signal, Slot

from engine.contract import (
    ContractError,
    ConversationsBody,
    EventsBody,
    MetricsBody,
    RequestsBody,
    parse,
)

T = TypeVar("T")  # a contract body type (engine.contract)

Callback = Callable[[Any], None]


class Dispatcher(QObject):
    """Runs work on a small thread pool and calls back on the thread that owns this object (the GUI thread)."""

    _done = Signal(object)

    def __init__(self, max_workers: int = 6, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="strata-desktop")
        self._closed = False
        self._done.connect(self._deliver)

    def submit(self, work: Callable[[], Any], callback: Callback | None = None) -> None:
        """Run `work()` off the GUI thread; `callback(result)` (or `callback(exception)`) runs on the GUI thread."""
        if self._closed:
            return

        def run() -> None:
            try:
                result: Any = work()
            except BaseException as e:  # handed to the callback, which decides what the user sees
                result = e
            if not self._closed and callback is not None:
                self._done.emit((callback, result))

        self._pool.submit(run)

    @Slot(object)
    def _deliver(self, item: tuple[Callback, Any]) -> None:
        callback, result = item
        if not self._closed:
            callback(result)

    def close(self, wait: bool = True) -> None:
        """Stop delivering results; with wait, join the workers (every request has a short timeout)."""
        self._closed = True
        self._pool.shutdown(wait=wait, cancel_futures=True)


@dataclass(frozen=True, slots=True)
class Reply:
    """The outcome of one HTTP call: ok (2xx), the status, the decoded JSON, or what went wrong."""

    ok: bool
    status: int | None
    data: Any
    error: str
    elapsed_ms: float

    @property
    def reachable(self) -> bool:
        return self.status is not None


def _error_message(status: int, data: Any, text: str) -> str:
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
        if data.get("detail"):
            return str(data["detail"])
    return f"HTTP {status}: {text[:200]}" if text else f"HTTP {status}"


class EngineClient(QObject):
    """The engine's HTTP API, called asynchronously. Replies from an earlier target are dropped."""

    def __init__(self, dispatcher: Dispatcher, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.dispatcher = dispatcher
        self.base_url: str | None = None
        self.api_key: str | None = None
        self._generation = 0
        self._http: Any = None  # httpx.Client, made on a worker thread: importing httpx costs start-up time
        self._http_lock = threading.Lock()

    @property
    def generation(self) -> int:
        """Counts the engines pointed at; an answer from an earlier one is dropped, its callback never called."""
        return self._generation

    def set_target(self, base_url: str | None, api_key: str | None = None) -> None:
        """Point at an engine (e.g. http://127.0.0.1:8080), or at none."""
        if base_url != self.base_url or api_key != self.api_key:
            self._generation += 1
        self.base_url = base_url.rstrip("/") if base_url else None
        self.api_key = api_key

    def request(self, method: str, path: str, callback: Callable[[Reply], None] | None = None, *,
                json: Any = None, timeout: float = 3.0) -> None:
        """Call the engine off the GUI thread; `callback(Reply)` runs on the GUI thread."""
        base, key, generation = self.base_url, self.api_key, self._generation
        if base is None:
            if callback is not None:
                callback(Reply(False, None, None, "the engine is not running", 0.0))
            return

        def work() -> Reply:
            return self.call(method, base + path, json=json, api_key=key, timeout=timeout)

        def done(result: Any) -> None:
            if generation != self._generation or callback is None:
                return
            if isinstance(result, BaseException):
                result = Reply(False, None, None, f"{type(result).__name__}: {result}", 0.0)
            callback(result)

        self.dispatcher.submit(work, done)

    def call(self, method: str, url: str, *, json: Any = None, api_key: str | None = None,
             timeout: float = 3.0) -> Reply:
        """One blocking HTTP call (worker threads only)."""
        import httpx

        with self._http_lock:
            if self._http is None:
                self._http = httpx.Client(limits=httpx.Limits(max_connections=8, max_keepalive_connections=4),
                                          trust_env=False)
            http = self._http
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        start = time.perf_counter()
        try:
            r = http.request(method, url, json=json, headers=headers, timeout=timeout)
        except httpx.TimeoutException:
            return Reply(False, None, None, f"no answer within {timeout:g} s", (time.perf_counter() - start) * 1e3)
        except httpx.HTTPError as e:
            return Reply(False, None, None, f"cannot connect ({type(e).__name__})", (time.perf_counter() - start) * 1e3)
        elapsed = (time.perf_counter() - start) * 1e3
        try:
            data = r.json()
        except ValueError:
            data = None
        ok = 200 <= r.status_code < 300
        return Reply(ok, r.status_code, data, "" if ok else _error_message(r.status_code, data, r.text), elapsed)

    def change_conversation(self, conversation_id: str, changes: dict[str, Any],
                            callback: Callable[[Reply], None] | None = None) -> None:
        """PATCH /cache/conversations/{id} with {"priority"?: "high"|"normal"|"low", "pinned"?: bool}."""
        check_conversation_change(changes)
        path = "/cache/conversations/" + urllib.parse.quote(conversation_id, safe="")
        self.request("PATCH", path, callback, json=changes)

    def drop_conversation(self, conversation_id: str, callback: Callable[[Reply], None] | None = None) -> None:
        """DELETE /cache/conversations/{id}: drop one parked conversation from every tier."""
        self.request("DELETE", "/cache/conversations/" + urllib.parse.quote(conversation_id, safe=""), callback)

    def close(self) -> None:
        with self._http_lock:
            if self._http is not None:
                self._http.close()


PRIORITIES = ("high", "normal", "low")


def check_conversation_change(changes: dict[str, Any]) -> None:
    """What PATCH /cache/conversations/{id} takes: a priority and/or a pin, nothing else (ValueError otherwise)."""
    unknown = set(changes) - {"priority", "pinned"}
    if not changes or unknown:
        raise ValueError(f"a conversation change is priority and/or pinned, got {sorted(changes)}")
    if "priority" in changes and changes["priority"] not in PRIORITIES:
        raise ValueError(f"priority: expected one of {', '.join(PRIORITIES)}, got {changes['priority']!r}")
    if "pinned" in changes and not isinstance(changes["pinned"], bool):
        raise ValueError(f"pinned: expected true or false, got {changes['pinned']!r}")


def change_failure(name: str, reply: Reply) -> str:
    """What to tell the user when the engine refused a conversation change: its own words, and what they mean."""
    text = reply.error or f"HTTP {reply.status}"
    if reply.status == 405 or (reply.status == 404 and "no route" in text):
        return (f"This engine cannot change a conversation's priority or pin (it has no PATCH "
                f"/cache/conversations/{{id}}; a newer engine has). The engine said: {text}")
    if reply.status == 404:
        return f"{name} is no longer parked, so there is nothing to change. The engine said: {text}"
    return f"Could not change {name}: {text}"


@dataclass(frozen=True, slots=True)
class MemorySample:
    """Memory at one moment: the engine's process tree RSS (None when not running) and the host's memory."""

    time: float
    engine_rss: int | None
    host_available: int
    host_total: int


def process_tree_rss(pid: int | None) -> int | None:
    """Resident memory of `pid` and all its descendants, in bytes; None if it is gone."""
    if not pid:
        return None
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total


def sample_memory(pid: int | None) -> MemorySample:
    vm = psutil.virtual_memory()
    return MemorySample(time.time(), process_tree_rss(pid), int(vm.available), int(vm.total))


class Poller(QObject):
    """Fetches what the Monitor shows on a timer. The event log only when asked for (`detail`); the parked
    conversations always, as the tray's count and a crash report (what was lost, what was kept) need them."""

    # Each body as the contract parsed it (engine/contract.py), typed all the way to the widgets.
    metrics = Signal(object)  # MetricsBody from /metrics
    conversations = Signal(object)  # list[ConversationRow] from /cache/conversations (a row per tier)
    conversations_failed = Signal(str)  # the engine answered /cache/conversations with an error
    events = Signal(object)  # list[Event] from /cache/events
    requests = Signal(object)  # list[RequestRecord] from /cache/requests (each request explained)
    requests_failed = Signal(str)  # the engine could not give the request log
    memory = Signal(object)  # MemorySample
    unreachable = Signal(str)  # the engine did not answer /metrics

    EVENTS_LIMIT = 200
    REQUESTS_LIMIT = 200

    def __init__(self, client: EngineClient, interval_ms: int = 1000, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.client = client
        self.engine_pid: int | None = None
        self.detail = True
        # What is being fetched, by the client generation it was asked of: a request to an engine that was
        # replaced meanwhile never calls back (EngineClient.request), so it must not keep its key busy.
        self._in_flight: dict[str, int] = {}
        self._timer = QTimer(self, interval=interval_ms)
        self._timer.timeout.connect(self.poll)

    def start(self) -> None:
        self._timer.start()
        self.poll()

    def stop(self) -> None:
        self._timer.stop()

    def set_interval(self, ms: int) -> None:
        self._timer.setInterval(ms)

    @property
    def interval_ms(self) -> int:
        return self._timer.interval()

    def poll(self) -> None:
        """One round: memory always; the engine's figures when it has a URL."""
        self._once("memory", lambda: sample_memory(self.engine_pid), self._on_memory)
        if self.client.base_url is None:
            return
        self._fetch("metrics", "/metrics", self._on_metrics)
        self._fetch("conversations", "/cache/conversations", self._on_conversations)
        if self.detail:
            self._fetch("events", f"/cache/events?limit={self.EVENTS_LIMIT}", self._on_events)
            self._fetch("requests", f"/cache/requests?limit={self.REQUESTS_LIMIT}", self._on_requests)

    def _busy(self, key: str) -> bool:
        return self._in_flight.get(key) == self.client.generation

    def _once(self, key: str, work: Callable[[], Any], done: Callback) -> None:
        if self._busy(key):
            return
        self._in_flight[key] = generation = self.client.generation

        def finish(result: Any) -> None:
            if self._in_flight.get(key) == generation:
                del self._in_flight[key]
            if not isinstance(result, BaseException):
                done(result)

        self.client.dispatcher.submit(work, finish)

    def _fetch(self, key: str, path: str, done: Callable[[Reply], None]) -> None:
        if self._busy(key):
            return
        self._in_flight[key] = generation = self.client.generation

        def finish(reply: Reply) -> None:
            if self._in_flight.get(key) == generation:
                del self._in_flight[key]
            done(reply)

        # A timeout shorter than two rounds keeps a hung engine from holding a worker for long.
        self.client.request("GET", path, finish, timeout=max(1.0, 2 * self._timer.interval() / 1000))

    def _on_memory(self, sample: MemorySample) -> None:
        self.memory.emit(sample)

    # Each answer is parsed with the engine's own contract (engine/contract.py): a shape the engine does not
    # serve is an error shown in the app, never read as empty figures.

    def _on_metrics(self, reply: Reply) -> None:
        if not reply.ok:
            self.unreachable.emit(reply.error or f"HTTP {reply.status}")
            return
        try:
            self.metrics.emit(parse(MetricsBody, reply.data, "GET /metrics"))
        except ContractError as exc:
            self.unreachable.emit(f"the engine's answer is not understood: {exc}")

    def _parsed(self, reply: Reply, cls: type[T], where: str, failed: Any | None) -> T | None:
        """The reply's body as `cls`, or None; a refusal from a reachable engine, or an answer not understood, is
        said on `failed` (when given)."""
        if not reply.ok:
            if reply.reachable and failed is not None:
                failed.emit(reply.error)
            return None
        try:
            return parse(cls, reply.data, where)
        except ContractError as exc:
            if failed is not None:
                failed.emit(f"the engine's answer is not understood: {exc}")
            return None

    def _on_conversations(self, reply: Reply) -> None:
        body = self._parsed(reply, ConversationsBody, "GET /cache/conversations", self.conversations_failed)
        if body is not None:
            self.conversations.emit(body.conversations)

    def _on_events(self, reply: Reply) -> None:
        if not reply.ok:  # the event log is a view of the past: a failed poll says nothing new
            return
        body = self._parsed(reply, EventsBody, "GET /cache/events", self.conversations_failed)
        if body is not None:
            self.events.emit(body.events)

    def _on_requests(self, reply: Reply) -> None:
        body = self._parsed(reply, RequestsBody, "GET /cache/requests", self.requests_failed)
        if body is not None:
            self.requests.emit(body.requests)
