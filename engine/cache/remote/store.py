"""What a remote store backend is: keyed bytes with a time to live, in batches. Nothing here knows Redis.

Three kinds of value: "block" (one block's state parts, named by its chained block key), "manifest" (a
conversation's token ids and the state of its last partial block, named by the key of its last full block) and
"holder" (named by a block key: the key of the latest manifest that goes through that block).
Every call takes and returns lists, so a backend batches them (a Redis pipeline, a Mooncake batch_get, parallel
S3 requests). A backend raises `StoreError` for every failure of the store, with a `state` the tier shows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

Kind = Literal["block", "manifest", "holder"]

# Why the store failed: "down" (unreachable, refused, timed out), "full" (out of memory under a no-eviction
# policy), "read_only" (a replica, or a store told to refuse writes), "denied" (authentication or ACL), "error"
STORE_STATES = ("down", "full", "read_only", "denied", "error")


class StoreError(Exception):
    """The store failed a call; `state` is one of STORE_STATES, the message never carries a password."""

    def __init__(self, state: str, message: str) -> None:
        assert state in STORE_STATES, state
        super().__init__(message)
        self.state = state


@dataclass(frozen=True, slots=True)
class StoreUsage:
    """What the store reports about itself: bytes used, its byte budget (0 = none) and its eviction policy."""

    used_bytes: int
    max_bytes: int
    policy: str


class RemoteStore(Protocol):
    """A shared key-value store of block and manifest values (bytes), each with a time to live."""

    def exists(self, kind: Kind, keys: Sequence[str]) -> list[bool]:
        """Whether each key is held, in order."""
        ...

    def get(self, kind: Kind, keys: Sequence[str]) -> list[bytes | None]:
        """Each key's value, None where it is not held."""
        ...

    def put(self, kind: Kind, items: Sequence[tuple[str, bytes]], ttl_s: int) -> None:
        """Store each (key, value), replacing what was there, to expire after `ttl_s` seconds."""
        ...

    def touch(self, kind: Kind, keys: Sequence[str], ttl_s: int) -> list[bool]:
        """Restart each held key's time to live; whether each was held."""
        ...

    def delete(self, kind: Kind, keys: Sequence[str]) -> None:
        """Remove each key (a key not held is no error)."""
        ...

    def usage(self) -> StoreUsage:
        """Ask the store how full it is (also what a health probe calls)."""
        ...

    def close(self) -> None: ...
