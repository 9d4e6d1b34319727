"""Which backend serves a store URL, and the tier over it: the one place a new backend (Mooncake, S3) is named."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading

from engine.cache.identity import CacheIdentity
from engine.cache.journal import Journal
from engine.cache.remote.store import RemoteStore
from engine.cache.remote.tier import RemoteTier
from engine.store_url import parse_store_url

log = logging.getLogger("strata.cache")


PASSWORD_VARIABLE = "STRATA_CONVERSATION_CACHE_REMOTE_PASSWORD"


def open_store(url: str, identity_key: str) -> tuple[RemoteStore, str]:
    """The backend for `url` (validated by the engine's settings already) and the URL as it may be shown. A URL
    without a password takes PASSWORD_VARIABLE's, which keeps it out of the process list (/proc/PID/cmdline)."""
    from engine.cache.remote.redis_store import RedisStore  # redis-py takes ~0.15 s to import: only when used

    parsed = parse_store_url(url)
    if not parsed.password and os.environ.get(PASSWORD_VARIABLE):
        parsed = dataclasses.replace(parsed, password=os.environ[PASSWORD_VARIABLE])
    return RedisStore(parsed, identity_key), parsed.redacted()


def open_remote(url: str, identity: CacheIdentity, lock: threading.RLock, journal: Journal, *, days: float,
                queue_bytes: int, engine_version: str) -> RemoteTier | None:
    """The started remote tier for `url` (its first probe made: an unreachable store is logged, not fatal)."""
    store, shown = open_store(url, identity.key)
    tier = RemoteTier(store, shown, identity, lock, journal, days=days, queue_bytes=queue_bytes,
                      engine_version=engine_version)
    tier.start()
    return tier
