"""The K/V floor: the per-token K/V layout, the preallocated per-slot buffers and pinned staging to a GPU.

Model, runtime and cache import this package; it imports none of them (only torch).
"""

from engine.kv.buffers import KVBuffers, KVLayout, Stage
from engine.kv.pinned_staging import PinnedStaging

__all__ = ["KVBuffers", "KVLayout", "PinnedStaging", "Stage"]
