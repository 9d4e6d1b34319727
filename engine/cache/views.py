"""What the conversation cache shows of itself: a row per parked conversation (`/cache/conversations`, the
Monitor's table) and the figures of `/cache/stats`. Pure reads of the tiers' indexes and the journal; the caller
(`ConversationCache`, facade.py) holds the cache's lock while they run."""

from __future__ import annotations

from collections.abc import Sequence

from engine.cache.disk_store import DiskStore
from engine.cache.index import TierIndex
from engine.cache.journal import Journal
from engine.cache.ram_tier import RamTier
from engine.cache.remote.tier import RemoteFigures
from engine.cache.settings import CacheSettings
from engine.cache.stats import CacheStats, ConversationInfo


def conversation_rows(tiers: Sequence[tuple[str, TierIndex]], state_bytes: int) -> list[ConversationInfo]:
    """Every conversation of `tiers` (name, index), most recently used first; `state_bytes` is one recurrent
    checkpoint's size (0 for a model without recurrent layers)."""
    rows = [
        ConversationInfo(
            conv.id,
            conv.n_tokens,
            index.conv_bytes(conv),
            tier,
            conv.created,
            conv.last_used,
            conv.hits,
            pending=tier == "disk" and not conv.on_disk,
            on_disk=tier == "disk" and conv.on_disk,
            priority=conv.priority,
            pinned=conv.pinned,
            name=conv.name,
            client=conv.client,
            system=conv.system,
            checkpoints=(n := len(conv.checkpoints) + sum(index.blocks[k].state for k in conv.keys)),
            checkpoint_bytes=n * state_bytes,
        )
        for tier, index in tiers
        for conv in index.convs.values()
    ]
    return sorted(rows, key=lambda r: r.last_used, reverse=True)


def cache_stats(s: CacheSettings, ram: RamTier, disk: DiskStore | None, j: Journal, remote: RemoteFigures, *,
                block_tokens: int, prefill_tokens_per_s: float | None) -> CacheStats:
    """The cache's settings, sizes and counters as one snapshot."""
    return CacheStats(
        enabled=s.enabled,
        storage=s.storage,
        dir=disk.files.folder if disk else s.dir,
        ram_bytes=s.ram_bytes,
        disk_bytes=s.disk_bytes,
        slots=s.slots,
        min_free_bytes=s.min_free_bytes,
        block_tokens=block_tokens,
        bytes_ram=ram.index.bytes,
        bytes_disk=disk.index.bytes if disk else 0,
        bytes_pending=disk.staging.pending_bytes() if disk else 0,
        entries_ram=len(ram.index.convs),
        entries_disk=len(disk.index.convs) if disk else 0,
        blocks_ram=len(ram.index.blocks),
        blocks_disk=len(disk.index.blocks) if disk else 0,
        refusals=dict(j.refusals),
        declined=dict(j.declined),
        park_ms=j.park_ms.summary(),
        restore_ms=j.restore_ms.summary(),
        restore_bandwidth=dict(j.bandwidth),
        prefill_tokens_per_s=prefill_tokens_per_s,
        disk_error=(disk.files.error or disk.files.write_error) if disk else "",
        remote=remote.remote,
        remote_state=remote.remote_state,
        remote_error=remote.remote_error,
        remote_bytes=remote.remote_bytes,
        remote_max_bytes=remote.remote_max_bytes,
        **j.counts,
    )
