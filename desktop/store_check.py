"""Settings' "Test connection" for the remote store: does the URL's store answer, and how is it set up?

Runs off the UI thread (SettingsTab submits it). Its answer never carries the password: the URL is shown redacted
and the store's own error messages do not repeat it.
"""

from __future__ import annotations

import os

from engine.store_url import parse_store_url

MIB = 1 << 20
PASSWORD_VARIABLE = "STRATA_CONVERSATION_CACHE_REMOTE_PASSWORD"  # the engine reads it too (a URL without one)


def check_store(url: str, timeout_s: float = 3.0) -> tuple[bool, str]:
    """(whether the store answered, one sentence saying what it is or what failed)."""
    import redis  # ~0.15 s to import: when a test is asked for, not when the app starts
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    try:
        parsed = parse_store_url(url)
    except ValueError as exc:
        return False, f"Not a store URL: {exc}"
    client = redis.Redis(host=parsed.host, port=parsed.port, db=parsed.db, username=parsed.username or None,
                         password=parsed.password or os.environ.get(PASSWORD_VARIABLE) or None, ssl=parsed.tls,
                         socket_connect_timeout=timeout_s, socket_timeout=timeout_s, retry=Retry(NoBackoff(), 0))
    try:
        info = client.info()
    except redis.RedisError as exc:
        return False, f"{parsed.redacted()} does not answer: {str(exc)[:200]}"
    finally:
        client.close()
    name = "Valkey" if "valkey_version" in info else "Redis"
    version = info.get("valkey_version") or info.get("redis_version", "?")
    used, most, policy = int(info.get("used_memory", 0)), int(info.get("maxmemory", 0)), info.get("maxmemory_policy")
    budget = f"{most // MIB:,} MiB" if most else "no maxmemory"
    text = f"{parsed.redacted()} answers: {name} {version}, {used / MIB:,.0f} MiB used of {budget}, eviction {policy}."
    if not most or policy == "noeviction":
        text += " Once full it will refuse writes: set maxmemory and maxmemory-policy allkeys-lru there."
    return True, text
