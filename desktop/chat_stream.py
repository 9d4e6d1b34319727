"""One streamed chat completion on a worker thread, its pieces handed to the GUI thread as Qt signals.

`ChatStream.start()` returns at once: a plain thread posts `POST /v1/chat/completions` with `stream: true` and
`stream_options.include_usage`, reads the server-sent events and emits `delta(text)` per piece of the answer and
`thought(text)` per piece of a thinking model's reasoning (`reasoning_content`), then
`finished(TurnStats)` or `failed(message)`. `cancel()` never waits: the stream stops emitting at once, and the
worker closes the connection at its next event, which makes the engine cancel the request and free its slot.
Signals emitted from the worker reach slots of objects living on the GUI thread as queued calls.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any

from PySide6.QtCore import QObject, Signal

# Who the engine lists these requests as (X-Strata-Client, engine/server/conversation_attrs.py): the Monitor's
# requests and conversations say "Strata Desktop chat", not the HTTP library's User-Agent.
CLIENT_NAME = "Strata Desktop chat"


@dataclass(frozen=True, slots=True)
class TurnStats:
    """What one assistant turn cost: the engine's usage, and the times this client saw."""

    prompt_tokens: int | None
    cached_tokens: int | None
    completion_tokens: int | None
    ttft_s: float | None  # request sent -> first piece of text (reasoning or answer)
    total_s: float
    stopped: bool = False  # cancelled by the user before the engine finished

    @property
    def tokens_per_s(self) -> float | None:
        """Decode speed after the first token (the first one's time is prefill, shown as ttft)."""
        n, ttft = self.completion_tokens, self.ttft_s
        if n is None or ttft is None or n < 2 or self.total_s <= ttft:
            return None
        return (n - 1) / (self.total_s - ttft)

    def summary(self) -> str:
        """'prompt 812 tokens · cached 790 (97 %) · first token 0.21 s · 48.3 tokens/s'"""
        parts = []
        if self.prompt_tokens is not None:
            parts.append(f"prompt {self.prompt_tokens:,} tokens")
        if self.cached_tokens is not None:
            share = f" ({100 * self.cached_tokens / self.prompt_tokens:.0f} %)" if self.prompt_tokens else ""
            parts.append(f"cached {self.cached_tokens:,}{share}")
        parts.append(f"first token {self.ttft_s:.2f} s" if self.ttft_s is not None else "first token –")
        speed = self.tokens_per_s
        parts.append(f"{speed:.1f} tokens/s" if speed is not None else "– tokens/s")
        if self.stopped:
            parts.append("stopped")
        return " · ".join(parts)


def _error_text(status: int, body: bytes) -> str:
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if isinstance(data, dict) and isinstance(data.get("error"), dict) and data["error"].get("message"):
        return f"The engine refused the request: {data['error']['message']}"
    text = body.decode("utf-8", errors="replace").strip()[:200]
    return f"The engine answered HTTP {status}" + (f": {text}" if text else "")


class ChatStream(QObject):
    """One request. Emits `delta` pieces, then exactly one of `finished` / `failed` unless cancelled first."""

    delta = Signal(str)
    thought = Signal(str)  # a thinking model's reasoning, streamed before its answer
    finished = Signal(object)  # TurnStats
    failed = Signal(str)

    def __init__(self, base_url: str, api_key: str | None, messages: list[dict[str, Any]], *,
                 max_tokens: int, connect_timeout_s: float = 10.0, read_timeout_s: float = 300.0,
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        assert base_url.startswith(("http://", "https://")), base_url
        assert max_tokens >= 1, max_tokens
        self.url = base_url.rstrip("/") + "/v1/chat/completions"
        self.api_key = api_key
        self.body = {"model": "default", "messages": [dict(m) for m in messages], "stream": True,
                     "stream_options": {"include_usage": True}, "max_tokens": max_tokens}
        self.connect_timeout_s, self.read_timeout_s = connect_timeout_s, read_timeout_s
        self._cancel = threading.Event()
        self._thread: threading.Thread | None = None
        self.started_at: float | None = None
        self.reached_end = False  # the worker read the stream's [DONE]: the engine finished the turn itself

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def start(self) -> None:
        assert self._thread is None, "a ChatStream runs once"
        self.started_at = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="strata-chat-stream", daemon=True)
        self._thread.start()

    def cancel(self) -> None:
        """Stop now: nothing more is emitted; the worker drops the connection at its next event."""
        self._cancel.set()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the worker (tests and shutdown only); True once it has ended."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def _emit(self, signal: Any, *args: Any) -> None:
        if not self._cancel.is_set():
            signal.emit(*args)

    def _run(self) -> None:
        import httpx  # here, not at import: the GUI starts without it

        headers = {"X-Strata-Client": CLIENT_NAME}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        timeout = httpx.Timeout(self.read_timeout_s, connect=self.connect_timeout_s)
        start = self.started_at or time.perf_counter()
        first: float | None = None
        usage: dict[str, Any] = {}
        try:
            with httpx.Client(trust_env=False, timeout=timeout) as http, \
                    http.stream("POST", self.url, json=self.body, headers=headers) as response:
                if response.status_code != 200:
                    self._emit(self.failed, _error_text(response.status_code, response.read()))
                    return
                for line in response.iter_lines():
                    if self._cancel.is_set():
                        return  # leaving the with-blocks closes the connection: the engine cancels the request
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        self.reached_end = True
                        break
                    event = json.loads(payload)
                    if "error" in event:
                        error = event["error"]
                        message = error.get("message") if isinstance(error, dict) else error
                        self._emit(self.failed, f"The engine stopped with an error: {message}")
                        return
                    if isinstance(event.get("usage"), dict):
                        usage = event["usage"]
                    for choice in event.get("choices") or []:
                        delta = choice.get("delta") or {}
                        for key, signal in (("reasoning_content", self.thought), ("content", self.delta)):
                            text = delta.get(key)
                            if text:
                                if first is None:
                                    first = time.perf_counter()
                                self._emit(signal, text)
        except httpx.TimeoutException:
            self._emit(self.failed, "The engine did not answer in time.")
            return
        except httpx.HTTPError as e:
            self._emit(self.failed, f"Cannot reach the engine ({type(e).__name__}).")
            return
        except ValueError as e:
            self._emit(self.failed, f"The engine sent an event that is not JSON: {e}")
            return
        except (AttributeError, TypeError, KeyError) as e:  # JSON, but not a chunk's shape (data: 5, choices: "x")
            self._emit(self.failed, f"The engine sent an event this app does not read ({type(e).__name__}: {e}).")
            return
        if not self.reached_end:
            self._emit(self.failed, "The engine ended the stream before it finished.")
            return
        details = usage.get("prompt_tokens_details")
        details = details if isinstance(details, dict) else {}  # another shape: the figures are unknown, not fatal
        self._emit(self.finished, TurnStats(
            prompt_tokens=usage.get("prompt_tokens"), cached_tokens=details.get("cached_tokens"),
            completion_tokens=usage.get("completion_tokens"),
            ttft_s=None if first is None else first - start, total_s=time.perf_counter() - start))
