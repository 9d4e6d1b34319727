"""Session files (POST /slots/{id}?action=save|restore) and the conversation/block files of the disk tier.

A session file is a conversation file with no block files: its state parts (today the `kv` tensor: attention
K/V) hold every token. A parked conversation on disk is the same kind of file whose first `n_blocks` blocks live
in shared `blk-*` files, so a saved slot and a parked conversation are one format with one identity rule and one
checksum scheme. Every file stores each state part (engine.cache.parts) as one tensor under the part's name.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from engine.atomic import atomic_write
from engine.cache.errors import SessionFileError
from engine.cache.fileformat import (
    FileFormatError,
    Header,
    encode_header,
    file_chunks,
    read_header,
    read_tensor,
)
from engine.cache.identity import CacheIdentity, canonical_json, identity_difference, token_array
from engine.cache.parts import Parts, check_state

MAX_NAME_BYTES = 255


def conversation_file(
    identity: CacheIdentity,
    tokens: np.ndarray,
    tail: Parts | None,
    *,
    n_blocks: int,
    engine_version: str,
    conversation_id: str = "",
    created: float | None = None,
    last_used: float | None = None,
    hits: int = 0,
    attrs: dict[str, str] | None = None,
    checkpoints: Mapping[int, Parts] | None = None,
) -> tuple[bytes, list[tuple[str, torch.Tensor]]]:
    """Header and tensors of a conversation file; `tail` holds tokens [n_blocks * block_tokens, len(tokens)).

    `attrs` are the conversation's priority, pinned ("true"/"false"), name and client, kept in the header too.

    `created`, `last_used` (epoch seconds) and `hits` are the conversation's history, kept in the header so a
    restart shows and orders it as it was (a file without `last_used`, written before it existed, is read
    with its mtime instead).
    """
    now = time.time()
    n = len(tokens)
    n_tail = n - n_blocks * identity.block_tokens
    assert n_tail >= 0, (n, n_blocks)
    tensors: list[tuple[str, torch.Tensor]] = [("tokens", torch.from_numpy(token_array(tokens)))]
    if n_tail:
        assert tail is not None, "the tail's state parts are missing"
        for spec in identity.parts:
            t = tail[spec.name]
            assert tuple(t.shape) == spec.shape(n_tail) and t.dtype == spec.dtype, (spec.name, tuple(t.shape))
            tensors.append((spec.name, t.contiguous()))
    meta = {
        "kind": "conversation",
        "engine_version": engine_version,
        "identity": canonical_json(identity.describe()),
        "identity_key": identity.key,
        "kv_key": identity.kv_key,
        "n_tokens": str(n),
        "n_blocks": str(n_blocks),
        "block_tokens": str(identity.block_tokens),
        "conversation_id": conversation_id,
        "created": repr(now if created is None else created),
        "last_used": repr(now if last_used is None else last_used),
        "hits": str(hits),
        **(attrs or {}),
    }
    if identity.state_parts:  # a hybrid model: its own checkpoints (positions not at a block end)
        positions = sorted(checkpoints or {})
        assert all(0 < p <= n for p in positions), positions
        for pos in positions:
            parts = checkpoints[pos]  # type: ignore[index]
            for spec in identity.state_parts:
                t = parts[spec.name]
                assert spec.fits(tuple(t.shape)) and t.dtype == spec.dtype, (spec.name, tuple(t.shape))
                tensors.append((checkpoint_tensor(pos, spec.name), t.contiguous()))
        meta["checkpoints"] = canonical_json(positions)
    return encode_header(tensors, meta), tensors


def checkpoint_tensor(position: int, part: str) -> str:
    """The tensor name of one state part of a conversation's own checkpoint at `position`."""
    return f"ck.{position}.{part}"


def checkpoint_positions(header: Header, identity: CacheIdentity) -> list[int]:
    """The positions of a hybrid conversation file's own checkpoints, each with every state part as the
    identity says (FileFormatError "corrupt" otherwise); [] for an attention-only model."""
    if not identity.state_parts:
        return []
    try:
        positions = header.json_meta("checkpoints")
        n = int(header.meta["n_tokens"])
    except (KeyError, ValueError):
        raise FileFormatError("corrupt", "a hybrid conversation file without its checkpoint list") from None
    if not isinstance(positions, list) or not all(isinstance(p, int) and 0 < p <= n for p in positions):
        raise FileFormatError("corrupt", "checkpoint positions outside the conversation")
    for pos in positions:
        for spec in identity.state_parts:
            entry = header.tensors.get(checkpoint_tensor(pos, spec.name))
            if entry is None or not spec.fits(entry.shape) or entry.dtype != spec.dtype:
                raise FileFormatError("corrupt", f"checkpoint at {pos}: state part {spec.name} is missing or wrong")
    return positions


def block_file(identity: CacheIdentity, key: str, parts: Parts, *, engine_version: str):
    """Header and tensors of one shared block file: every state part, under its name."""
    tensors = []
    for spec in identity.parts:
        t = parts[spec.name]
        assert tuple(t.shape) == spec.shape(identity.block_tokens) and t.dtype == spec.dtype, spec.name
        tensors.append((spec.name, t.contiguous()))
    if identity.state_parts and identity.state_parts[0].name in parts:  # the checkpoint at the block's end
        for spec in identity.state_parts:
            t = parts[spec.name]
            assert tuple(t.shape) == spec.dims and t.dtype == spec.dtype, spec.name
            tensors.append((spec.name, t.contiguous()))
    meta = {
        "kind": "block",
        "engine_version": engine_version,
        "identity": canonical_json(identity.describe()),
        "identity_key": identity.key,
        "kv_key": identity.kv_key,
        "block_key": key,
    }
    return encode_header(tensors, meta), tensors


def check_identity(header: Header, identity: CacheIdentity, *, kv_only: bool) -> None:
    """Raise FileFormatError("foreign") unless the file was written under a compatible identity."""
    meta = header.meta
    ok = meta.get("kv_key") == identity.kv_key if kv_only else meta.get("identity_key") == identity.key
    if ok:
        return
    try:
        theirs = header.json_meta("identity")
    except (KeyError, ValueError):
        theirs = "<missing>"
    mine = identity.describe()
    if kv_only and isinstance(theirs, dict):
        mine = {k: v for k, v in mine.items() if k != "block_tokens"}
        theirs = {k: v for k, v in theirs.items() if k != "block_tokens"}
    raise FileFormatError(
        "foreign", f"written for another model or K/V layout ({identity_difference(mine, theirs)})"
    )


def check_conversation(header: Header, identity: CacheIdentity, *, session: bool) -> tuple[int, int]:
    """Validate a conversation file's header against `identity`; returns (n_tokens, n_blocks)."""
    meta = header.meta
    if meta.get("kind") != "conversation":
        raise FileFormatError(
            "corrupt", f"a {meta.get('kind')!r} file where a conversation file was expected"
        )
    check_identity(header, identity, kv_only=session)
    try:
        n, n_blocks = int(meta["n_tokens"]), int(meta["n_blocks"])
    except (KeyError, ValueError):
        raise FileFormatError("corrupt", "no token count in the header") from None
    if session and n_blocks:
        raise FileFormatError(
            "corrupt", "a parked conversation that needs its block files, not a session file"
        )
    n_tail = n - n_blocks * identity.block_tokens
    tok = header.tensors.get("tokens")
    if n < 0 or n_blocks < 0 or n_tail < 0 or tok is None or tok.dtype != torch.int32 or tok.shape != (n,):
        raise FileFormatError("corrupt", "token ids do not match the header's token count")
    parts = [header.tensors.get(spec.name) for spec in identity.parts]
    if n_tail == 0 and all(p is None for p in parts):
        return n, n_blocks
    for spec, entry in zip(identity.parts, parts, strict=True):
        if entry is None or entry.shape != spec.shape(n_tail) or entry.dtype != spec.dtype:
            raise FileFormatError("corrupt", f"state part {spec.name} does not match the token count and layout")
    return n, n_blocks


def save_session(
    path: str, identity: CacheIdentity, tokens: Sequence[int], kv: torch.Tensor, *, engine_version: str,
    checkpoints: Mapping[int, Parts] | None = None,
) -> int:
    """Write a slot's tokens and K/V ([n_layers, 2, n, kv_heads, head_dim]) to `path` atomically; returns bytes.

    A hybrid model's slot also gives its recurrent-state `checkpoints` by position, the state after all n tokens
    among them, stored as a parked conversation keeps its own."""
    toks = token_array(tokens)
    if identity.state_parts:
        if not checkpoints or len(toks) not in checkpoints:
            raise ValueError("a hybrid model's session needs its recurrent state after its tokens")
        checkpoints = {p: check_state(identity.state_parts, c) for p, c in checkpoints.items() if 0 < p <= len(toks)}
    if kv.device.type != "cpu":
        kv = kv.cpu()
    if tuple(kv.shape) != identity.layout.host_shape(len(toks)) or kv.dtype != identity.layout.dtype:
        raise ValueError(
            f"session K/V has shape {tuple(kv.shape)} {kv.dtype}, expected "
            f"{identity.layout.host_shape(len(toks))} {identity.layout.dtype} for {len(toks)} tokens"
        )
    refuse_folder(path)
    header, tensors = conversation_file(identity, toks, {"kv": kv}, n_blocks=0, engine_version=engine_version,
                                        checkpoints=checkpoints)
    return atomic_write(path, file_chunks(header, tensors))


def refuse_folder(path: str) -> None:
    """Raise SessionFileError when `path` is a folder. Asked before opening: Windows answers "Permission denied"
    for a folder opened as a file, which would send the user looking at access rights."""
    if os.path.isdir(path):
        raise SessionFileError(f"session file {os.path.basename(path)!r} is a folder, expected a file")


def load_session(path: str, identity: CacheIdentity) -> tuple[list[int], torch.Tensor]:
    """Read and fully verify a session file; raises SessionFileError before returning any data."""
    tokens, kv, _ = load_session_parts(path, identity)
    return tokens, kv


def load_session_parts(path: str, identity: CacheIdentity) -> tuple[list[int], torch.Tensor, dict[int, Parts]]:
    """`load_session` plus a hybrid model's recurrent-state checkpoints by position, the one after all the file's
    tokens among them ({} for attention only)."""
    name = os.path.basename(path)
    refuse_folder(path)
    try:
        with open(path, "rb", buffering=0) as f:
            header = read_header(f)
            check_conversation(header, identity, session=True)
            tokens = read_tensor(f, header, "tokens")
            parts = {
                s.name: read_tensor(f, header, s.name)
                if s.name in header.tensors
                else torch.empty(s.shape(0), dtype=s.dtype)
                for s in identity.parts
            }
            kv = parts["kv"]  # a slot takes attention K/V: the one part a model has today
            states: dict[int, Parts] = {}
            if identity.state_parts:
                positions = checkpoint_positions(header, identity)
                if int(header.meta["n_tokens"]) not in positions:
                    raise FileFormatError("corrupt", "no recurrent state after its tokens")
                states = {p: {s.name: read_tensor(f, header, checkpoint_tensor(p, s.name))
                              for s in identity.state_parts} for p in positions}
    except FileNotFoundError:
        raise SessionFileError(f"session file {name!r} does not exist") from None
    except FileFormatError as exc:
        what = {
            "truncated": "is truncated",
            "corrupt": "is corrupt",
            "foreign": "was saved by another model",
            "alien": "is not a Strata session file",
            "version": "has an unsupported format version",
        }.get(exc.reason, "cannot be read")
        raise SessionFileError(f"session file {name!r} {what}: {exc}") from None
    except OSError as exc:
        raise SessionFileError(f"session file {name!r} cannot be read: {exc.strerror or exc}") from None
    return tokens.tolist(), kv, states


def safe_session_path(folder: str, filename: str) -> str:
    """`folder/filename` for a plain basename; raises ValueError saying why any other name is refused."""
    if not isinstance(filename, str) or filename == "":
        raise ValueError("filename: expected a plain file name, got an empty name")
    if "\x00" in filename:
        raise ValueError("filename: expected a plain file name, got one with a NUL byte")
    if any(ord(c) < 0x20 for c in filename):
        raise ValueError("filename: expected a plain file name, got one with control characters")
    if "/" in filename or "\\" in filename or (os.name == "nt" and ":" in filename):
        raise ValueError(f"filename: expected a plain file name without folders, got {filename!r}")
    if filename in (".", ".."):
        raise ValueError(f"filename: expected a plain file name, got {filename!r}")
    if len(filename.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        raise ValueError(f"filename: expected at most {MAX_NAME_BYTES} bytes, got {len(filename.encode())}")
    path = os.path.join(folder, filename)
    real_folder = os.path.realpath(folder)
    if os.path.dirname(os.path.realpath(path)) != real_folder:
        raise ValueError(f"filename: {filename!r} leads outside the session folder")
    return path
