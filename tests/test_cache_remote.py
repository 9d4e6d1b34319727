"""The remote tier on a real redis-server: two caches (two engines' worth: other folders, one model identity) share
parked conversations through it; damaged, foreign and missing values are refused; a store that goes away or
fills up changes nothing about serving but shows in the figures."""

from __future__ import annotations

import logging
import os
import signal

import pytest
import torch

from engine.cache import CacheRestoreError, ConversationCache
from engine.cache.remote.values import encode_block
from tests.redis_server import free_port, redis_server
from tests.test_cache_support import BLOCK, FakeSlots, conversation, identity, make_cache, park_tokens


@pytest.fixture
def store(tmp_path):
    with redis_server(tmp_path) as server:
        yield server


def pair(store, tmp_path, **kw) -> tuple[ConversationCache, ConversationCache]:
    """Engine A's cache and engine B's: other folders, the same model identity, one store."""
    kw = {"storage": "tiered", **kw}
    return tuple(make_cache(remote_url=store.url, dir=str(tmp_path / name), **kw)  # type: ignore[return-value]
                 for name in ("a", "b"))


def restores_from_remote(cache: ConversationCache, slots: FakeSlots, tokens: list[int], n: int) -> None:
    """A request that goes on from `tokens` restores its first `n` from the store, byte for byte."""
    hit = cache.lookup(tokens + [7, 8])
    assert hit is not None and hit.tier == "remote" and hit.n_tokens == n, hit
    slots.kv.clear(1)
    assert cache.restore(hit, slots.writer(1)).tier == "remote"
    slots.fill(0, tokens)
    assert torch.equal(slots.kv.read(1, 0, n), slots.snapshot(0, n))


def test_second_cache_resumes_what_the_first_parked_through_the_store(store, tmp_path):
    a, b = pair(store, tmp_path)
    slots = FakeSlots()
    system = conversation(1, 4 * BLOCK)
    first, second = conversation(2, 6 * BLOCK + 5, system), conversation(3, 5 * BLOCK + 9, system)
    parked = park_tokens(a, slots, first)
    assert parked.parked and park_tokens(a, slots, second).parked
    assert a.flush(10)
    client = store.client()
    ttl = client.ttl(sorted(client.keys(f"strata:kv:{a.identity.key}:b:*"))[0])
    assert 29 * 86400 < ttl <= 30 * 86400  # --conversation-cache-days
    put = a.stats()
    assert put.remote_blocks_put == 6 + 1  # the shared system prompt is stored once
    assert put.remote_state == "up" and put.remote_bytes_put > 0
    assert b.lookup(first + [7]).conversation_id == parked.conversation_id  # A's id: one conversation, two engines
    restores_from_remote(b, slots, first, len(first))  # every token, the partial last block from the manifest
    restores_from_remote(b, slots, second, len(second))
    long = conversation(16, 40 * BLOCK + 3)  # three batches of blocks, fetched while the previous is verified
    assert park_tokens(a, slots, long).parked and a.flush(10)
    restores_from_remote(b, slots, long, len(long))
    st = b.stats()
    assert st.remote_hits == 3 and st.remote_refused == 0 and st.entries_ram == 0  # nothing resident in B
    # B parks what it goes on with: the blocks it read are known to be in the store, only new ones are sent
    longer = first + conversation(4, 2 * BLOCK)
    assert park_tokens(b, slots, longer).parked and b.flush(10)
    assert b.stats().remote_blocks_put == 2
    for cache in (a, b):
        cache.close(spill=True)


def _flip(value: bytes, key: str) -> bytes:
    damaged = bytearray(value)
    damaged[-100] ^= 0x01  # one bit of K/V: the tensor checksum sees it
    return bytes(damaged)


def _foreign(value: bytes, key: str) -> bytes:
    """A block another model wrote, stored under this model's key (a store is no trust boundary)."""
    other = identity(model={"name": "another model"})
    return encode_block(other, key, {"kv": torch.zeros(other.parts[0].shape(BLOCK))}, engine_version="test")


@pytest.mark.parametrize(("damage", "reason"), [(_flip, "checksum mismatch"), (lambda v, k: v[:-7], "truncated"),
                                                (_foreign, "foreign")], ids=["flipped", "truncated", "foreign"])
def test_damaged_truncated_and_foreign_values_are_refused_and_counted(store, tmp_path, caplog, damage, reason):
    a, b = pair(store, tmp_path)
    slots = FakeSlots()
    tokens = conversation(5, 3 * BLOCK)
    park_tokens(a, slots, tokens)
    assert a.flush(10)
    client = store.client()
    name = sorted(client.keys(f"strata:kv:{a.identity.key}:b:*"))[1]
    client.set(name, damage(client.get(name), name.decode().rsplit(":", 1)[1]))
    with caplog.at_level(logging.WARNING, "strata.cache"):
        hit = b.lookup(tokens + [7])
        assert hit is not None and hit.tier == "remote"
        slots.kv.clear(1)
        with pytest.raises(CacheRestoreError, match="refused"):
            b.restore(hit, slots.writer(1))
    assert not slots.kv.read(1, 0, len(tokens)).any()  # nothing reached the slot
    assert b.stats().remote_refused == 1 and reason in caplog.text
    assert not client.exists(name)  # a refused value is removed; an engine that holds it writes it again
    for cache in (a, b):
        cache.close(spill=False)


def test_a_store_that_goes_away_leaves_ram_and_disk_serving_and_shows_it(store, tmp_path, caplog):
    a, b = pair(store, tmp_path)
    slots = FakeSlots()
    tokens = conversation(6, 4 * BLOCK + 3)
    park_tokens(a, slots, tokens)
    assert a.flush(10)
    hit = b.lookup(tokens + [7])
    assert hit is not None and hit.tier == "remote"
    store.stop()  # between the lookup and the restore's read
    with caplog.at_level(logging.WARNING, "strata.cache"):
        slots.kv.clear(1)
        with pytest.raises(CacheRestoreError, match="remote store failed"):
            b.restore(hit, slots.writer(1))
        assert not slots.kv.read(1, 0, len(tokens)).any()
        for _ in range(3):
            assert b.lookup(tokens + [7]) is None  # the store is down: a cold prefill, no error
        local = conversation(7, 3 * BLOCK)
        assert park_tokens(b, slots, local).parked  # the local tiers go on
        hit = b.lookup(local + [7])
        assert hit is not None and hit.tier == "ram"
    st = b.stats()
    assert st.remote_state == "down" and "cannot reach" in st.remote_error and st.remote_errors == 1
    assert st.restore_failures == 1 and st.remote_hits == 0
    assert caplog.text.count("remote store") == 1  # one warning, not one per request
    for cache in (a, b):
        cache.close(spill=False)


def test_a_full_store_refuses_writes_and_serving_goes_on(tmp_path, caplog):
    with redis_server(tmp_path, "--maxmemory", "1mb", "--maxmemory-policy", "noeviction") as server:
        cache = make_cache(remote_url=server.url)
        slots = FakeSlots()
        with caplog.at_level(logging.WARNING, "strata.cache"):
            for seed in range(4):  # 4 x 40 KiB of blocks per park, past the store's 1 MiB
                assert park_tokens(cache, slots, conversation(10 + seed, 40 * BLOCK)).parked
                cache.flush(10)
        st = cache.stats()
        assert st.remote_state == "full" and st.remote_errors >= 1 and st.entries_ram == 4
        assert "noeviction" in caplog.text and "full" in caplog.text
        cache.close(spill=False)


def test_a_store_that_comes_back_is_used_again_and_gets_what_is_parked_next(store, tmp_path, caplog):
    a, b = pair(store, tmp_path)
    slots = FakeSlots()
    tokens = conversation(8, 3 * BLOCK + 2)
    park_tokens(a, slots, tokens)
    assert a.flush(10)
    store.stop()
    park_tokens(a, slots, tokens + conversation(9, BLOCK))  # its write fails: the store is down
    a.flush(10)
    assert a.stats().remote_state == "down"
    with caplog.at_level(logging.WARNING, "strata.cache"), redis_server(tmp_path, port=store.port):  # empty
        for cache in (a, b):
            assert cache.remote is not None
            cache.remote.retry_at = 0.0  # due for another try now rather than after PROBE_S
        longer = tokens + conversation(10, 2 * BLOCK)
        assert park_tokens(a, slots, longer).parked and a.flush(10)
        assert a.stats().remote_state == "up" and "usable again" in caplog.text
        restores_from_remote(b, slots, longer, len(longer))  # every block sent again, not only the new ones
    for cache in (a, b):
        cache.close(spill=False)


def test_a_read_only_store_serves_reads_and_refuses_writes_without_stopping_parks(tmp_path):
    # a replica of a primary that is not there: it answers reads and refuses every write with READONLY
    with redis_server(tmp_path, "--replicaof", "127.0.0.1", str(free_port())) as server:
        cache = make_cache(remote_url=server.url)
        slots = FakeSlots()
        tokens = conversation(11, 3 * BLOCK)
        assert park_tokens(cache, slots, tokens).parked
        cache.flush(10)
        st = cache.stats()
        assert st.remote_state == "read_only" and "refuses writes" in st.remote_error and st.remote_errors == 1
        hit = cache.lookup(tokens + [7])
        assert hit is not None and hit.tier == "ram"
        assert cache.lookup(tokens + conversation(12, 2 * BLOCK)).tier == "ram"  # the store read: nothing there
        assert cache.stats().remote_state == "read_only"  # a read going through does not clear it
        cache.close(spill=False)


def test_blocks_the_store_evicted_are_sent_again_from_the_disk_files_at_the_next_park(store, tmp_path):
    a, b = pair(store, tmp_path, storage="disk")
    slots = FakeSlots()
    tokens = conversation(13, 4 * BLOCK + 1)
    park_tokens(a, slots, tokens)
    assert a.flush(10)  # written on disk: A keeps no K/V of it in RAM now
    client = store.client()
    evicted = sorted(client.keys(f"strata:kv:{a.identity.key}:b:*"))[:2]
    client.delete(*evicted)  # as the store's LRU would
    longer = tokens + conversation(14, BLOCK + 3)
    assert park_tokens(a, slots, longer).parked and a.flush(10)
    assert all(client.exists(k) for k in evicted)
    restores_from_remote(b, slots, longer, len(longer))
    for cache in (a, b):
        cache.close(spill=False)


def test_a_store_with_a_password_takes_it_from_the_url_or_the_environment_and_never_shows_it(
        tmp_path, monkeypatch, caplog):
    with redis_server(tmp_path, password="hunter2") as server, \
            caplog.at_level(logging.INFO, "strata.cache"):
        slots = FakeSlots()
        tokens = conversation(15, 2 * BLOCK)
        wrong = make_cache(remote_url=f"redis://:wrong@127.0.0.1:{server.port}/0")
        st = wrong.stats()
        assert st.remote_state == "denied" and st.remote == f"redis://:***@127.0.0.1:{server.port}/0"
        wrong.close(spill=False)
        monkeypatch.setenv("STRATA_CONVERSATION_CACHE_REMOTE_PASSWORD", "hunter2")
        cache = make_cache(remote_url=server.url)
        assert park_tokens(cache, slots, tokens).parked and cache.flush(10)
        assert cache.stats().remote_state == "up" and cache.stats().remote_blocks_put == 2
        cache.close(spill=False)
    assert "hunter2" not in caplog.text and "wrong" not in caplog.text


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="no SIGSTOP to make a store hang on this platform")
def test_a_store_that_stops_answering_fails_one_lookup_then_is_skipped(store, tmp_path):
    a, b = pair(store, tmp_path)
    slots = FakeSlots()
    tokens = conversation(17, 3 * BLOCK)
    park_tokens(a, slots, tokens)
    assert a.flush(10)
    os.kill(store.proc.pid, signal.SIGSTOP)  # connections still accepted by the kernel, nothing answered
    try:
        assert b.lookup(tokens + [7]) is None  # after the lookup's short timeout: a cold prefill
        st = b.stats()
        assert st.remote_state == "down" and st.remote_errors == 1
        assert b.lookup(tokens + [7]) is None and b.stats().remote_errors == 1  # not asked again until due
    finally:
        os.kill(store.proc.pid, signal.SIGCONT)
    for cache in (a, b):
        cache.close(spill=False)


def test_a_hybrid_conversation_resumes_on_the_other_cache_from_its_checkpoints(store, tmp_path):
    from tests.test_cache_checkpoints import Slots, hybrid, park, state_at

    ident = hybrid()
    a, b = (make_cache(ident, remote_url=store.url, storage=storage, dir=str(tmp_path / name))
            for name, storage in (("a", "disk"), ("b", "ram")))
    slots = Slots()
    system = conversation(18, 4 * BLOCK)
    tokens = conversation(19, 6 * BLOCK + 3, system)
    # a checkpoint at the system prompt's end (a block end: stored in that block), one at a prompt end, the end
    assert park(a, slots, tokens, [4 * BLOCK, 4 * BLOCK + 5, len(tokens)]).parked and a.flush(10)
    for request, want in ((tokens + [7, 8], len(tokens)),  # a follow-up: from the end
                          (tokens[: 4 * BLOCK + 9] + [1, 2, 3], 4 * BLOCK + 5),  # an edit: the prompt end before it
                          (tokens[: 4 * BLOCK + 2] + [5, 5, 5], 4 * BLOCK)):  # from the block's checkpoint
        hit = b.lookup(request)
        assert hit is not None and hit.tier == "remote" and hit.n_tokens == want, (hit, want)
        got: dict = {}
        b.restore(hit, slots.writer(1, got))
        assert list(got) == [want] and all(torch.equal(got[want][k], v) for k, v in state_at(request, want).items())
        slots.fill(0, tokens)
        assert torch.equal(slots.kv.read(1, 0, want), slots.kv.read(0, 0, want))
    assert b.lookup(tokens[: 3 * BLOCK] + [9] * 20) is None  # no checkpoint before the edit: nothing to resume
    for cache in (a, b):
        cache.close(spill=False)
