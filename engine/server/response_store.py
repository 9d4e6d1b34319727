"""Stored responses of the Responses API (`store`, `previous_response_id`): each response's conversation as
chat-template messages, so a follow-up that names it continues it. The K/V itself is not kept here: it is the
conversation cache's, found by prefix like any other conversation's.

Kept in memory, the most recent MAX_STORED, until the engine stops (a restart forgets them, while the conversation
cache keeps their K/V): a client that needs more sends the whole input each turn (`store: false`), as Codex does.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_STORED = 256


@dataclass(frozen=True, slots=True)
class StoredResponse:
    history: list[dict[str, Any]]  # input and output turns, without the request's instructions
    body: dict[str, Any]  # the response object as returned


class ResponseStore:
    def __init__(self, capacity: int = MAX_STORED) -> None:
        assert capacity > 0
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def put(self, response_id: str, stored: StoredResponse) -> None:
        with self._lock:
            self._items[response_id] = stored
            self._items.move_to_end(response_id)
            while len(self._items) > self._capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            stored = self._items.get(response_id)
            if stored is not None:
                self._items.move_to_end(response_id)
            return stored

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._items.pop(response_id, None) is not None
