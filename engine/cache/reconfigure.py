"""Live reconfiguration of the conversation cache (`ConversationCache.reconfigure`): storage mode, folder and
budgets change on a running engine without losing what is parked, unless a budget shrinks.

ram -> disk writes every RAM conversation before returning, as a tiered RAM budget made smaller writes what it
evicts (past the write buffer's bound, which is for parks as they come); a new folder receives the old folder's
entries; leaving disk storage keeps the files where they are for a later return.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

from engine.cache.disk_reads import move_entries
from engine.cache.settings import CacheSettings

if TYPE_CHECKING:
    from engine.cache.facade import ConversationCache

log = logging.getLogger("strata.cache")


def apply(cache: ConversationCache, settings: CacheSettings) -> list[str]:
    """Apply new settings live; returns the names that changed. Nothing parked is lost unless budgets shrink.

    Raises ValueError for a change that cannot be made live and CacheDirLockedError for a folder another
    engine holds; in both cases nothing changed.
    """
    old = cache.settings
    changed = [f.name for f in dataclasses.fields(CacheSettings) if getattr(old, f.name) != getattr(settings, f.name)]
    if not changed:
        return []
    if settings.block_tokens != old.block_tokens:
        raise ValueError("block_tokens cannot change on a running engine; restart with the new value")
    with cache.lock:
        cache.journal.losses.begin("settings change", changed=changed)
    wants_disk = settings.uses_disk
    new_disk = None
    if wants_disk and (cache.disk is None or settings.dir != old.dir):
        new_disk = cache.open_disk(settings)  # may raise: nothing changed yet
    if cache.disk is not None and (new_disk is not None or not wants_disk):
        cache.disk.stop_writer(time.monotonic() + 600)
        with cache.lock:
            if new_disk is not None:
                move_entries(cache.disk, new_disk)
            else:
                log.info(
                    "conversation cache: %d conversations stay in %s until disk storage is used again",
                    len(cache.disk.index.convs),
                    cache.disk.files.folder,
                )
            cache.disk.files.close()
            cache.disk = None
    with cache.lock:
        if new_disk is not None:
            cache.disk = new_disk
        cache.set_settings(settings)
    if cache.disk is not None:
        cache.disk.start_writer()
    if cache.ram.index.convs and not settings.uses_ram and cache.disk is not None:
        # ram -> disk: every RAM conversation is written before the change returns
        with cache.lock:
            for cid in list(cache.ram.index.convs):
                cache.disk.queue_spill(*cache.ram.take(cid), bounded=False)
        cache.disk.drain(time.monotonic() + 600)
        with cache.lock:
            cache.reap()
    moved = cache.enforce_budgets(spill_all=True)  # tiered: a smaller RAM budget moves conversations to disk
    if moved and cache.disk is not None and settings.storage == "tiered":
        cache.disk.drain(time.monotonic() + 600)  # before a later park's write-buffer bound could drop them
        with cache.lock:
            cache.reap()
    log.info("conversation cache: reconfigured %s", ", ".join(changed))
    return changed
