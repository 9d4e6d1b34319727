"""The token ids the engine generated for the answers it returned, so that when a client sends an answer back (every
chat turn, every agent step) the prompt holds the very ids whose K/V was computed, not the tokenizer's spelling of
the same text (BPE has many spellings of one string, and a sampled one is often not the canonical one: a switch-back
then diverged at the first answer and recomputed everything after it).

Keyed by the answer's text; the most recent answers up to MAX_TOKENS tokens in all. In memory: after a restart an
answer is tokenized again, and the conversation cache reuses the prompt up to it.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import xxhash

MAX_TOKENS = 4 << 20  # 16 MiB of ids


def _key(text: str) -> bytes:
    return xxhash.xxh3_128_digest(text.encode("utf-8", "surrogatepass"))


class AnswerIds:
    def __init__(self, max_tokens: int = MAX_TOKENS) -> None:
        assert max_tokens > 0
        self._items: OrderedDict[bytes, array] = OrderedDict()
        self._tokens = 0
        self._max = max_tokens
        self._lock = threading.Lock()

    def remember(self, tokenizer: Any, generated: Sequence[int]) -> None:
        """Keep the ids of an answer (without its final end-of-turn token) under the text they decode to, the text
        the client received."""
        ids = list(generated)
        if ids and ids[-1] in tokenizer.eos_token_ids:
            ids.pop()
        if not ids or len(ids) > self._max:
            return
        key = _key(tokenizer.decode(ids))
        with self._lock:
            old = self._items.pop(key, None)
            self._tokens -= len(old) if old is not None else 0
            self._items[key] = array("i", ids)
            self._tokens += len(ids)
            while self._tokens > self._max:
                _, dropped = self._items.popitem(last=False)
                self._tokens -= len(dropped)

    def get(self, text: str) -> list[int] | None:
        with self._lock:
            ids = self._items.get(_key(text))
            if ids is None:
                return None
            self._items.move_to_end(_key(text))
            return ids.tolist()

