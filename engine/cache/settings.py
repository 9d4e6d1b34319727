"""The conversation cache's settings, taken from EngineConfig (the one table of settings)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from engine.config import STORAGE_MODES, EngineConfig

MIB = 1 << 20

# Each cache setting, the EngineConfig field it comes from, and the scale from that field's unit to the cache's
# (MiB -> bytes). `dir` is not here: it comes from EngineConfig.cache_dir (the folder once defaults apply).
FROM_CONFIG: dict[str, tuple[str, int]] = {
    "storage": ("conversation_cache_storage", 1),
    "ram_bytes": ("conversation_cache_mib", MIB),
    "disk_bytes": ("conversation_cache_disk_mib", MIB),
    "slots": ("conversation_cache_slots", 1),
    "min_free_bytes": ("conversation_cache_min_free_mib", MIB),
    "days": ("conversation_cache_days", 1),
    "block_tokens": ("conversation_cache_block_tokens", 1),
    "n_min": ("conversation_cache_n_min", 1),
    "similarity": ("conversation_cache_similarity", 1),
    # RAM held by pending disk writes (disk-mode parks and tiered spills) until the background writer has written
    # them: the bound on how much engine RSS a park can add in disk mode, beyond the RAM budget in tiered mode.
    # When full, the oldest pending write is dropped (counted in spill_dropped); a disk-mode park bigger than the
    # whole bound is written to its files before the park returns instead.
    "spill_queue_bytes": ("conversation_cache_write_buffer_mib", MIB),
    # the shared store parks are written through to (engine/cache/remote); "" = none. Its writes not sent yet
    # are bounded by spill_queue_bytes too, counted apart from the disk's
    "remote_url": ("conversation_cache_remote", 1),
}
_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(EngineConfig)}


def _default(name: str) -> Any:
    """The cache setting's default, from the declaration of the EngineConfig field it comes from."""
    source, scale = FROM_CONFIG[name]
    value: Any = _DEFAULTS[source]
    return value * scale if scale != 1 else value


@dataclass(frozen=True, slots=True)
class CacheSettings:
    """What the cache obeys; `dir` is the parent folder (the cache adds one subfolder per identity).

    Every default is the engine's (engine/config.py), scaled to the cache's units: one table of settings."""

    storage: str = _default("storage")
    ram_bytes: int = _default("ram_bytes")
    disk_bytes: int = _default("disk_bytes")
    dir: str = ""
    slots: int = _default("slots")
    min_free_bytes: int = _default("min_free_bytes")
    days: float = _default("days")
    block_tokens: int = _default("block_tokens")
    n_min: int = _default("n_min")
    similarity: float = _default("similarity")
    spill_queue_bytes: int = _default("spill_queue_bytes")
    remote_url: str = dataclasses.field(default=_default("remote_url"), repr=False)  # may carry a password

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
        values = {name: getattr(cfg, source) * scale if scale != 1 else getattr(cfg, source)
                  for name, (source, scale) in FROM_CONFIG.items()}
        return cls(dir=cfg.cache_dir, **values)

    def replace(self, **changes: Any) -> CacheSettings:
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


assert {f.name for f in dataclasses.fields(CacheSettings)} == set(FROM_CONFIG) | {"dir"}, "one source per setting"
