"""Errors raised by the conversation cache; each message says what was wrong and what to do."""

from __future__ import annotations


class CacheError(Exception):
    """Base class of every conversation-cache error."""


class CacheRestoreError(CacheError):
    """A hit could not be restored; raised before any byte reached the slot, so the slot is a clean miss."""


class SessionFileError(CacheError):
    """A session file is corrupt, truncated, from another model or of another format version; nothing was loaded."""


class CacheDirLockedError(CacheError):
    """Another engine holds the cache folder of this model; two engines never share one folder."""


class ParkRefused(CacheError):
    """A park (or a spill) that cannot be made; `reason` is one word for counters and `ParkResult.reason`.

    Raised inside the cache only: `ConversationCache.park` turns it into a refused `ParkResult`.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
