"""The conversation cache's settings, taken from EngineConfig (the one table of settings)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.config import STORAGE_MODES, EngineConfig

MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class CacheSettings:
    """What the cache obeys; `dir` is the parent folder (the cache adds one subfolder per identity)."""

    storage: str = "ram"
    ram_bytes: int = 4096 * MIB
    disk_bytes: int = 16384 * MIB
    dir: str = ""
    slots: int = 64
    min_free_bytes: int = 1024 * MIB
    days: float = 30.0
    block_tokens: int = 64
    n_min: int = 0
    similarity: float = 0.0
    # RAM held by pending disk writes (disk-mode parks and tiered spills) until the background writer has written
    # them: the bound on how much engine RSS a park can add in disk mode, beyond the RAM budget in tiered mode.
    # When full, the oldest pending write is dropped (counted in spill_dropped); a disk-mode park bigger than the
    # whole bound is written to its files before the park returns instead.
    spill_queue_bytes: int = 1024 * MIB

    def __post_init__(self) -> None:
        if self.storage not in STORAGE_MODES:
            raise ValueError(f"storage: expected one of {', '.join(STORAGE_MODES)}, got {self.storage!r}")
        for name in ("ram_bytes", "disk_bytes", "min_free_bytes", "spill_queue_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: expected a whole number of bytes >= 0, got {getattr(self, name)}")
        if self.slots < 1 or self.block_tokens < 1 or self.n_min < 0 or self.days < 0:
            raise ValueError(f"cache settings out of range: {self}")
        if not 0.0 <= self.similarity < 1.0:
            raise ValueError(f"similarity: expected a number in [0, 1), got {self.similarity}")
        if self.storage != "ram" and not self.dir:
            raise ValueError(f"dir: storage {self.storage!r} needs a folder")

    @classmethod
    def from_engine_config(cls, cfg: EngineConfig) -> CacheSettings:
        return cls(
            storage=cfg.conversation_cache_storage,
            ram_bytes=cfg.conversation_cache_mib * MIB,
            disk_bytes=cfg.conversation_cache_disk_mib * MIB,
            dir=cfg.cache_dir,
            slots=cfg.conversation_cache_slots,
            min_free_bytes=cfg.conversation_cache_min_free_mib * MIB,
            days=cfg.conversation_cache_days,
            block_tokens=cfg.conversation_cache_block_tokens,
            n_min=cfg.conversation_cache_n_min,
            similarity=cfg.conversation_cache_similarity,
            spill_queue_bytes=cfg.conversation_cache_write_buffer_mib * MIB,
        )

    def replace(self, **changes) -> CacheSettings:
        return dataclasses.replace(self, **changes)

    @property
    def uses_ram(self) -> bool:
        return self.storage in ("ram", "tiered") and self.ram_bytes > 0

    @property
    def uses_disk(self) -> bool:
        return self.storage in ("disk", "tiered") and self.disk_bytes > 0

    @property
    def enabled(self) -> bool:
        return self.uses_ram or self.uses_disk
