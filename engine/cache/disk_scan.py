"""The disk tier's start-up scan: index a cache folder from file headers only (no payload is read), removing our
leftovers (temp files, orphaned blocks) and every file of ours that cannot be used, each counted by why.

A block file is kept when its header names this identity and its key with every part's spec; a conversation manifest
when its header and token ids check out, it has not expired and every block it names is kept. What is kept goes into
the tier's index, oldest use first.
"""

from __future__ import annotations

import logging
import os
import time

from engine import startup_progress
from engine.atomic import is_temp_name
from engine.cache.attrs import DEFAULT_PRIORITY, MAX_CLIENT_CHARS, MAX_NAME_CHARS, PRIORITIES
from engine.cache.disk_files import BLOCK_RE, CONV_RE, OURS_RE, block_name, unlink
from engine.cache.fileformat import FileFormatError, read_header, read_tensor
from engine.cache.identity import CacheIdentity, block_keys
from engine.cache.index import Block, Conv, TierIndex
from engine.cache.lifecycle import EntryState
from engine.cache.session_file import check_conversation, check_identity, checkpoint_positions

log = logging.getLogger("strata.cache")

DAY = 86400.0
_REASONS = ("alien", "foreign", "version", "corrupt", "truncated")


def scan_folder(folder: str, identity: CacheIdentity, index: TierIndex, *, days: float) -> tuple[dict[str, int], str]:
    """Index `folder` into `index` from headers only; remove our leftovers and every file that cannot be used.

    Returns the counts of what was removed, by why, and why the folder could not be listed ("" when it could).
    """
    removed = {
        "temp": 0,
        "malformed": 0,
        "foreign": 0,
        "version": 0,
        "corrupt": 0,
        "truncated": 0,
        "expired": 0,
        "orphan": 0,
        "incomplete": 0,
        "unreadable": 0,
    }
    try:
        names = sorted(os.listdir(folder))
    except OSError as exc:
        error = f"cannot list cache folder {folder}: {exc.strerror or exc}"
        log.error("conversation cache: %s", error)
        return removed, error
    now = time.time()
    blocks: dict[str, tuple[int, bool]] = {}  # key -> (file bytes, holds the checkpoint at its end)
    convs: list[tuple[str, str]] = []
    for done, name in enumerate(names):
        startup_progress.report(done, len(names))  # GET /health shows the fraction while the engine starts
        path = os.path.join(folder, name)
        if is_temp_name(name) and OURS_RE.match(name[1 : name.rindex(".tmp-")]):
            if os.path.isfile(path) and unlink(path):
                removed["temp"] += 1
            continue
        if not OURS_RE.match(name):
            continue  # not ours: never touched
        if not os.path.isfile(path) or os.path.islink(path):
            log.warning("conversation cache: %s is not a regular file; ignored", path)
            continue
        if days == 0:
            removed["expired"] += unlink(path)
            continue
        if m := BLOCK_RE.match(name):
            reason, state = _check_block_file(path, m.group(1), identity)
            if reason:
                removed[reason] += unlink(path)
            else:
                st = os.stat(path)
                blocks[m.group(1)] = (st.st_size, state)
        elif m := CONV_RE.match(name):
            convs.append((m.group(1), path))
        else:
            removed["malformed"] += unlink(path)
    loaded: list[Conv] = []
    for conv_id, path in convs:
        try:
            st = os.stat(path)
            conv = _read_manifest(path, conv_id, st.st_size, st.st_mtime, identity)
            if days and now - conv.last_used > days * DAY:
                removed["expired"] += unlink(path)
                continue
        except FileFormatError as exc:
            log.info("conversation cache: removing %s (%s)", path, exc)
            reason = {"alien": "foreign"}.get(exc.reason, exc.reason)
            removed[reason if reason in removed else "corrupt"] += unlink(path)
            continue
        except OSError as exc:
            log.info("conversation cache: removing unreadable %s (%s)", path, exc.strerror or exc)
            removed["unreadable"] += unlink(path)
            continue
        if any(k not in blocks for k in conv.keys):
            removed["incomplete"] += unlink(path)
            continue
        loaded.append(conv)
    held = {k for conv in loaded for k in conv.keys}
    for key in list(blocks):
        if key not in held:
            removed["orphan"] += unlink(os.path.join(folder, block_name(key)))
            del blocks[key]
    for conv in sorted(loaded, key=lambda c: c.last_used):
        new = [Block(k, blocks[k][0], on_disk=True, state=blocks[k][1]) for k in conv.keys
               if k not in index.blocks]
        # the same block may appear twice in one conversation only if keys repeat, which chaining rules out
        index.add(conv, new)
    gone = {k: v for k, v in removed.items() if v}
    log.info(
        "conversation cache ready: %d conversations, %d blocks, %.1f MiB on disk (%s)%s",
        len(index.convs),
        len(index.blocks),
        index.bytes / (1 << 20),
        folder,
        f"; removed {gone}" if gone else "",
    )
    return removed, ""


def _check_block_file(path: str, key: str, identity: CacheIdentity) -> tuple[str, bool]:
    """("", holds a checkpoint) when the block file is usable (header only), else (the reason to remove it, _)."""
    try:
        with open(path, "rb", buffering=0) as f:
            header = read_header(f)
        check_identity(header, identity, kv_only=False)
        n = identity.block_tokens
        state = {s.name for s in identity.state_parts}
        names = {s.name for s in identity.parts}
        has_state = bool(state) and set(header.tensors) == names | state
        ok = (
            header.meta.get("kind") == "block"
            and header.meta.get("block_key") == key
            and (set(header.tensors) == names or has_state)
            and all(
                header.tensors[s.name].shape == s.shape(n) and header.tensors[s.name].dtype == s.dtype
                for s in identity.parts + (identity.state_parts if has_state else ())
            )
        )
        return ("" if ok else "corrupt"), has_state
    except FileFormatError as exc:
        return ({"alien": "foreign"}.get(exc.reason, exc.reason) if exc.reason in _REASONS else "corrupt"), False
    except OSError:
        return "unreadable", False


def _read_manifest(path: str, conv_id: str, size: int, mtime: float, identity: CacheIdentity) -> Conv:
    """A conversation's index entry from its manifest's header and token ids; FileFormatError when unusable."""
    with open(path, "rb", buffering=0) as f:
        header = read_header(f)
        n, n_blocks = check_conversation(header, identity, session=False)
        positions = checkpoint_positions(header, identity)
        tokens = read_tensor(f, header, "tokens").numpy()
    if header.meta.get("conversation_id") != conv_id:
        raise FileFormatError("corrupt", "conversation id in the header does not match the file name")
    keys = block_keys(identity.key, tokens, identity.block_tokens)
    if len(keys) != n_blocks:
        raise FileFormatError("corrupt", "block count does not match the token count")
    # The history fields are vouched for by the header checksum; a manifest written before `last_used`
    # existed falls back to its mtime (what it used to be), one without `created` to the same.
    meta = header.meta
    try:
        last_used = float(meta.get("last_used", mtime))
        created, hits = float(meta.get("created", last_used)), max(0, int(meta.get("hits", "0")))
    except ValueError:
        last_used, created, hits = mtime, mtime, 0
    conv = Conv(
        conv_id, tokens, keys, size, created=created, last_used=last_used, hits=hits, state=EntryState.WRITTEN,
        checkpoints=dict.fromkeys(positions),
    )
    conv.set_attrs(_attrs_of(meta))
    return conv


def _attrs_of(meta: dict[str, str]) -> tuple[str, bool, str, str, str]:
    """A manifest's priority, pin, name, client and system words; one written before they existed (or with a
    value this version does not know) reads as the defaults: normal, unpinned, no name, no client, no system."""
    priority = meta.get("priority", DEFAULT_PRIORITY)
    return (
        priority if priority in PRIORITIES else DEFAULT_PRIORITY,
        meta.get("pinned") == "true",
        str(meta.get("name", ""))[:MAX_NAME_CHARS],
        str(meta.get("client", ""))[:MAX_CLIENT_CHARS],
        str(meta.get("system", ""))[:MAX_NAME_CHARS],
    )
