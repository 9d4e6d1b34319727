"""The bytes a block or a manifest is stored as in the remote tier: the disk tier's files, byte for byte.

A block's value is a `blk-*` file (session_file.block_file), a manifest's a `conv-*` file (conversation_file):
one format, one checksum scheme and one identity rule for disk and store. Decoding checks everything before a
byte is used: the header checksum, the identity (the key already names it; the value must say the same), that
the value is the one its key names (a block's own key; a manifest's tokens chain to the key it is stored under),
and each tensor's checksum and shape. Anything else raises FileFormatError, whose reason the tier counts.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from engine.cache.fileformat import FileFormatError, file_chunks, read_header, read_tensor
from engine.cache.identity import CacheIdentity, block_keys, canonical_json
from engine.cache.parts import Parts
from engine.cache.session_file import (
    block_file,
    check_conversation,
    check_identity,
    checkpoint_positions,
    checkpoint_tensor,
    conversation_file,
)


@dataclass(frozen=True, slots=True)
class Manifest:
    """A conversation as the store holds it: its id where it was parked, its tokens, its last partial block."""

    conversation_id: str
    tokens: np.ndarray  # int32
    n_blocks: int
    tail: Parts | None
    # a hybrid model: its own checkpoints by position, and the blocks (by index) stored with the one at their end
    checkpoints: dict[int, Parts] = field(default_factory=dict)
    block_states: tuple[int, ...] = ()


def encode_block(identity: CacheIdentity, key: str, parts: Parts, *, engine_version: str) -> bytes:
    header, tensors = block_file(identity, key, parts, engine_version=engine_version)
    return b"".join(file_chunks(header, tensors))


def decode_block(identity: CacheIdentity, key: str, value: bytes) -> Parts:
    """The block's state parts; FileFormatError unless the value is that block of this identity, undamaged."""
    f = io.BytesIO(value)
    header = read_header(f, len(value))
    if header.meta.get("kind") != "block":
        raise FileFormatError("corrupt", f"a {header.meta.get('kind')!r} value where a block was expected")
    check_identity(header, identity, kv_only=False)
    if header.meta.get("block_key") != key:
        raise FileFormatError("corrupt", "the value names another block than the key it is stored under")
    parts: Parts = {}
    for spec in identity.parts:
        entry = header.tensors.get(spec.name)
        if entry is None or entry.shape != spec.shape(identity.block_tokens) or entry.dtype != spec.dtype:
            raise FileFormatError("corrupt", f"state part {spec.name} is missing or does not match the layout")
        parts[spec.name] = read_tensor(f, header, spec.name)
    if identity.state_parts and identity.state_parts[0].name in header.tensors:  # the checkpoint at its end
        for spec in identity.state_parts:
            entry = header.tensors.get(spec.name)
            if entry is None or entry.shape != spec.dims or entry.dtype != spec.dtype:
                raise FileFormatError("corrupt", f"state part {spec.name} is missing or does not match the layout")
            parts[spec.name] = read_tensor(f, header, spec.name)
    return parts


def encode_manifest(identity: CacheIdentity, conversation_id: str, tokens: np.ndarray, tail: Parts | None,
                    *, n_blocks: int, engine_version: str, checkpoints: Mapping[int, Parts] | None = None,
                    block_states: Sequence[int] = ()) -> bytes:
    attrs = {"block_states": canonical_json(sorted(block_states))} if identity.state_parts else None
    header, tensors = conversation_file(identity, tokens, tail, n_blocks=n_blocks, engine_version=engine_version,
                                        conversation_id=conversation_id, checkpoints=checkpoints, attrs=attrs)
    return b"".join(file_chunks(header, tensors))


def decode_manifest(identity: CacheIdentity, last_key: str, value: bytes) -> Manifest:
    """The manifest stored under `last_key` (its last full block's key); FileFormatError unless it is one of this
    identity whose tokens chain to that key, undamaged."""
    f = io.BytesIO(value)
    header = read_header(f, len(value))
    n, n_blocks = check_conversation(header, identity, session=False)
    tokens = read_tensor(f, header, "tokens").numpy()
    keys = block_keys(identity.key, tokens, identity.block_tokens)
    if n_blocks < 1 or len(keys) != n_blocks or keys[-1] != last_key:
        raise FileFormatError("corrupt", "the manifest's tokens do not lead to the key it is stored under")
    tail = None
    if n > n_blocks * identity.block_tokens:
        tail = {spec.name: read_tensor(f, header, spec.name) for spec in identity.parts}
    checkpoints = {p: {s.name: read_tensor(f, header, checkpoint_tensor(p, s.name)) for s in identity.state_parts}
                   for p in checkpoint_positions(header, identity)}
    states: tuple[int, ...] = ()
    if identity.state_parts:
        try:
            listed = header.json_meta("block_states")
        except (KeyError, ValueError):
            listed = None
        if not isinstance(listed, list) or not all(isinstance(i, int) and 0 <= i < n_blocks for i in listed):
            raise FileFormatError("corrupt", "a hybrid manifest without a valid list of blocks holding a state")
        states = tuple(listed)
    return Manifest(header.meta.get("conversation_id", ""), tokens, n_blocks, tail, checkpoints, states)
