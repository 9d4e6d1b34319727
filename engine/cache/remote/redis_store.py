"""The Redis/Valkey backend of the remote tier (redis-py, which speaks to both).

Key layout: `strata:kv:<identity key>:b:<block key>` for a block, `strata:kv:<identity key>:m:<block key>` for a
manifest, `strata:kv:<identity key>:h:<block key>` for a holder pointer, so one store serves several models side by side and an operator can count or drop one model's keys
with a pattern. Every batch is one pipeline (one round trip), without a transaction: each key stands alone.
Calls fail fast (short timeouts, no retries here): the tier decides when to try the store again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from engine.cache.remote.store import Kind, StoreError, StoreUsage
from engine.store_url import StoreURL

CONNECT_TIMEOUT_S = 1.0
# A lookup (EXISTS, a manifest: small) runs while a request waits on the engine thread, so a store that accepts
# connections but does not answer (stopped, overloaded) costs it at most this; blocks (megabytes, over a link
# that may be slow) go through their own connections with the longer timeout, off the engine thread.
QUICK_TIMEOUT_S = 1.0
BULK_TIMEOUT_S = 5.0
PUT_BATCH_BYTES = 64 << 20  # bytes sent in one pipeline: bounds the client's buffers, not the store's


class RedisStore:
    """`RemoteStore` on a Redis or Valkey server."""

    def __init__(self, url: StoreURL, identity_key: str) -> None:
        self.url = url
        self.prefix = f"strata:kv:{identity_key}:"
        self.bulk, self.quick = (redis.Redis(
            host=url.host, port=url.port, db=url.db, username=url.username or None, password=url.password or None,
            ssl=url.tls, socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=timeout,
            retry=Retry(NoBackoff(), 0), health_check_interval=0, client_name="strata",
        ) for timeout in (BULK_TIMEOUT_S, QUICK_TIMEOUT_S))

    def key(self, kind: Kind, key: str) -> str:
        return f"{self.prefix}{kind[0]}:{key}"  # b:, m:, h:

    def client(self, kind: Kind) -> redis.Redis:
        return self.bulk if kind == "block" else self.quick

    def exists(self, kind: Kind, keys: Sequence[str]) -> list[bool]:
        with _errors():
            pipe = self.quick.pipeline(transaction=False)  # keys only: quick whatever their kind
            for k in keys:
                pipe.exists(self.key(kind, k))
            return [bool(n) for n in pipe.execute()]

    def get(self, kind: Kind, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        with _errors():
            return list(self.client(kind).mget([self.key(kind, k) for k in keys]))  # type: ignore[arg-type]

    def put(self, kind: Kind, items: Sequence[tuple[str, bytes]], ttl_s: int) -> None:
        with _errors():
            for batch in _batches(items, PUT_BATCH_BYTES):
                pipe = self.client(kind).pipeline(transaction=False)
                for k, value in batch:
                    pipe.set(self.key(kind, k), value, ex=ttl_s)
                pipe.execute()

    def touch(self, kind: Kind, keys: Sequence[str], ttl_s: int) -> list[bool]:
        with _errors():
            pipe = self.bulk.pipeline(transaction=False)  # the writer's, beside its puts
            for k in keys:
                pipe.expire(self.key(kind, k), ttl_s)
            return [bool(n) for n in pipe.execute()]

    def delete(self, kind: Kind, keys: Sequence[str]) -> None:
        if keys:
            with _errors():
                self.quick.delete(*(self.key(kind, k) for k in keys))

    def usage(self) -> StoreUsage:
        with _errors():
            info = self.quick.info("memory")
        assert isinstance(info, dict), type(info)
        return StoreUsage(int(info.get("used_memory", 0)), int(info.get("maxmemory", 0)),
                          str(info.get("maxmemory_policy", "")))

    def close(self) -> None:
        for client in (self.bulk, self.quick):
            client.close()


def _batches(items: Sequence[tuple[str, bytes]], limit: int) -> Iterator[Sequence[tuple[str, bytes]]]:
    start, size = 0, 0
    for i, (_, value) in enumerate(items):
        if size and size + len(value) > limit:
            yield items[start:i]
            start, size = i, 0
        size += len(value)
    if start < len(items):
        yield items[start:]


@contextlib.contextmanager
def _errors() -> Iterator[None]:
    """Turns redis-py's exceptions into StoreError with the state the tier shows (no URL, so no password)."""
    try:
        yield
    except redis.RedisError as exc:
        raise _store_error(exc) from None


def _store_error(exc: redis.RedisError) -> StoreError:
    text = str(exc)[:160]
    if isinstance(exc, redis.exceptions.OutOfMemoryError) or text.startswith("OOM"):
        return StoreError("full", f"the store is full and evicts nothing ({text})")
    if isinstance(exc, redis.exceptions.ReadOnlyError) or text.startswith("READONLY"):
        return StoreError("read_only", "the store refuses writes (a read-only replica?)")
    if isinstance(exc, redis.exceptions.AuthenticationError | redis.exceptions.AuthorizationError
                  | redis.exceptions.NoPermissionError) or text.startswith(("NOAUTH", "WRONGPASS", "NOPERM")):
        return StoreError("denied", f"the store refused the user or password ({text})")
    if isinstance(exc, redis.ConnectionError | redis.TimeoutError):
        return StoreError("down", f"cannot reach the store ({text})")
    return StoreError("error", f"the store answered an error ({text})")
