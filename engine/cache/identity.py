"""What a parked conversation is tied to (model, K/V layout, block size) and the chained block keys derived from it.

A block's key is xxh3-128 over (the previous block's key, the block's token ids as little-endian int32). Block 0
chains from the identity key, so equal keys mean equal tokens from position 0 under the same model and layout:
matching a request never reads K/V, and keys are the same in every process (no Python `hash()`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from engine.cache import window
from engine.cache.parts import PartSpec, describe_parts, layout_parts, state_specs
from engine.kv import KVLayout

FORMAT_VERSION = 1
"""Version of the key derivation and of the file format; files of another version are never restored."""


def canonical_json(value: object) -> str:
    """JSON with sorted keys and no spaces: the same bytes for the same value in every process."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


@dataclass(frozen=True)
class CacheIdentity:
    """The model (as the engine describes it), the K/V layout and the block size a parked conversation needs."""

    model: dict
    layout: KVLayout
    block_tokens: int
    state: dict | None = None  # a hybrid model's recurrent state layout (`StateLayout.describe()`)
    # a sliding-window model: its window and local layers (indices into the layout's layers). Blocks then hold
    # the global layers only, and each conversation its local layers' last window (engine/cache/window.py)
    window: int | None = None
    local_layers: tuple[int, ...] = ()
    # per-token parts parked beside the layout's K/V (a draft's own rows: `--spec mtp` parks the target's hidden
    # row of each token with its next-token layer's K/V), named in `describe` so its files never mix with others
    extra_parts: tuple[PartSpec, ...] = ()

    def __post_init__(self) -> None:
        if self.block_tokens < 1:
            raise ValueError(f"block_tokens: expected a whole number >= 1, got {self.block_tokens}")
        canonical_json(self.model)  # refuses a model description that is not JSON-able
        if self.local_layers:
            assert self.window and self.window > 0 and not self.state, (self.window, self.state)
            assert list(self.local_layers) == sorted(set(self.local_layers)), self.local_layers
            assert self.local_layers[0] >= 0 and self.local_layers[-1] < self.layout.n_layers, self.local_layers
        assert all(p.per_token and p.name != "kv" for p in self.extra_parts), self.extra_parts

    def describe(self) -> dict:
        """Everything the identity covers, as JSON-able data (stored in every file).

        The state parts are named only when they are not the layout's (attention K/V alone), so the key of every
        attention-only model, and the files parked under it, stay what they were."""
        out = {
            "format_version": FORMAT_VERSION,
            "model": self.model,
            "layout": self.layout.describe(),
            "block_tokens": self.block_tokens,
        }
        if self.parts != layout_parts(self.layout):
            out["parts"] = describe_parts(self.parts)
        if self.state_parts:
            out["state_parts"] = describe_parts(self.state_parts)
        if self.local_layers:
            out["window"] = {"tokens": self.window, "local_layers": list(self.local_layers)}
        return out

    @functools.cached_property
    def key(self) -> str:
        """Stable hex key of the whole identity: names the cache folder and seeds block 0's key."""
        return xxhash.xxh3_128_hexdigest(canonical_json(self.describe()).encode())

    @functools.cached_property
    def kv_key(self) -> str:
        """Key of what K/V compatibility needs (model and layout, not block size): session files check this."""
        kv = {k: v for k, v in self.describe().items() if k != "block_tokens"}
        return xxhash.xxh3_128_hexdigest(canonical_json(kv).encode())

    def __hash__(self) -> int:
        return hash(self.key)

    @functools.cached_property
    def parts(self) -> tuple[PartSpec, ...]:
        """The state parts every parked block and tail holds: the attention K/V of every layer, or of the
        global layers only for a sliding-window model."""
        if self.local_layers:
            return (window.global_part(self.layout, self.local_layers), *self.extra_parts)
        return layout_parts(self.layout) + self.extra_parts

    @functools.cached_property
    def state_parts(self) -> tuple[PartSpec, ...]:
        """The parts of one checkpoint: a hybrid model's recurrent state, a sliding-window model's local layers'
        rows (`window`), none for the others."""
        if self.local_layers:
            return (window.window_part(self.layout, self.local_layers),)
        return state_specs(self.state) if self.state else ()

    @property
    def state_bytes(self) -> int:
        """Bytes of one checkpoint, every state part together (a window's: W - 1 rows, what a resume reads)."""
        return sum(spec.nbytes((self.window or 1) - 1) for spec in self.state_parts)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token's state, every part together."""
        return sum(spec.nbytes(1) for spec in self.parts)

    @property
    def block_bytes(self) -> int:
        """Bytes of one full block's state."""
        return self.block_tokens * self.bytes_per_token


def token_array(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as a little-endian int32 array (the form keys and files use); refuses ids out of int32 range."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens: expected a flat sequence of token ids, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype="<i4")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"tokens: expected integer token ids, got {arr.dtype}")
    if arr.dtype != np.dtype("<i4"):
        if int(arr.min()) < 0 or int(arr.max()) > 0x7FFFFFFF:
            raise ValueError("tokens: expected token ids in [0, 2**31), got one outside")
        arr = arr.astype("<i4")
    return np.ascontiguousarray(arr)


def tokens_key(identity_key: str, tokens: np.ndarray) -> str:
    """Key of an exact token sequence under a model identity: what a hit promises its restore will hold."""
    return xxhash.xxh3_128_hexdigest(identity_key.encode() + token_array(tokens).tobytes())


def block_keys(
    identity_key: str, tokens: np.ndarray, block_tokens: int, *, limit: int | None = None
) -> list[str]:
    """Keys of the full blocks of `tokens` (int32 array), chained from `identity_key`; at most `limit` keys."""
    n_blocks = len(tokens) // block_tokens
    if limit is not None:
        n_blocks = min(n_blocks, limit)
    keys: list[str] = []
    prev = bytes.fromhex(identity_key)
    data = tokens[: n_blocks * block_tokens].tobytes()
    step = block_tokens * 4
    for i in range(n_blocks):
        h = xxhash.xxh3_128(prev)
        h.update(data[i * step : (i + 1) * step])
        prev = h.digest()
        keys.append(prev.hex())
    return keys


def identity_difference(mine: dict, theirs: object, prefix: str = "") -> str:
    """First difference between two identity descriptions, worded for an error message."""
    if not isinstance(theirs, dict):
        return f"{prefix or 'identity'}: {canonical_json(mine)[:80]} here, {str(theirs)[:80]} in the file"
    for name in sorted(set(mine) | set(theirs)):
        a, b = mine.get(name, "<missing>"), theirs.get(name, "<missing>")
        if a == b:
            continue
        path = f"{prefix}.{name}" if prefix else name
        if isinstance(a, dict) and isinstance(b, dict):
            return identity_difference(a, b, path)
        return f"{path}: {str(a)[:80]} here, {str(b)[:80]} in the file"
    return "identical descriptions"
