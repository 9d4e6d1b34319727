"""The conversation cache: parks switched-out conversations' K/V in RAM or on disk and restores them.

The engine sees only this interface: `ConversationCache` (lookup / park / restore / purge / conversations /
stats / events / reconfigure / close), `CacheIdentity`, `CacheSettings`, the result dataclasses, the session-file
functions and the errors.
"""

from engine.cache.errors import CacheDirLockedError, CacheError, CacheRestoreError, SessionFileError
from engine.cache.facade import ConversationCache
from engine.cache.identity import FORMAT_VERSION, CacheIdentity, block_keys, token_array
from engine.cache.session_file import load_session, safe_session_path, save_session
from engine.cache.settings import CacheSettings
from engine.cache.stats import (
    CacheHit,
    CacheStats,
    ConversationInfo,
    ParkResult,
    PurgeResult,
    RestoreResult,
    Timing,
)

__all__ = [
    "FORMAT_VERSION",
    "CacheDirLockedError",
    "CacheError",
    "CacheHit",
    "CacheIdentity",
    "CacheRestoreError",
    "CacheSettings",
    "CacheStats",
    "ConversationCache",
    "ConversationInfo",
    "ParkResult",
    "PurgeResult",
    "RestoreResult",
    "SessionFileError",
    "Timing",
    "block_keys",
    "load_session",
    "safe_session_path",
    "save_session",
    "token_array",
]
