"""The disk tier's files: one folder per identity, shared block files, conversation manifests, a lock file.

Names this tier owns (and the only files it ever removes): `blk-<32 hex>.safetensors` (one block's state parts, shared by
every conversation that contains it), `conv-<16 hex>.safetensors` (a conversation: its token ids and the state parts of
its last partial block; its full blocks are the `blk-*` files named by its chained keys), temp files
`.<one of those>.tmp-<pid>-<hex>`, and `strata-cache.lock`. Any other `blk-*`/`conv-*` `.safetensors` name
(`conv-hacked-9.safetensors`) is malformed and removed; anything else in the folder is never touched.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import time

import numpy as np

from engine import startup_progress
from engine.atomic import is_temp_name, publish, write_temp
from engine.cache.attrs import DEFAULT_PRIORITY, MAX_CLIENT_CHARS, MAX_NAME_CHARS, PRIORITIES
from engine.cache.errors import CacheDirLockedError
from engine.cache.fileformat import FileFormatError, file_chunks, read_header, read_tensor
from engine.cache.identity import CacheIdentity, block_keys
from engine.cache.index import Block, Conv, History, TierIndex
from engine.cache.lifecycle import EntryState
from engine.cache.parts import Parts
from engine.cache.session_file import (
    block_file,
    check_conversation,
    check_identity,
    checkpoint_positions,
    checkpoint_tensor,
    conversation_file,
)

log = logging.getLogger("strata.cache")

BLOCK_RE = re.compile(r"^blk-([0-9a-f]{32})\.safetensors$")
CONV_RE = re.compile(r"^conv-([0-9a-f]{16})\.safetensors$")
OURS_RE = re.compile(r"^(blk|conv)-.*\.safetensors$")
LOCK_NAME = "strata-cache.lock"
DAY = 86400.0
_REASONS = ("alien", "foreign", "version", "corrupt", "truncated")


def os_reason(exc: BaseException) -> str:
    """A failed file operation in words an operator can search for, without the path: the errno's name and the
    system's message ('ENOSPC (No space left on device)'); another exception's type and message."""
    if isinstance(exc, OSError) and exc.errno is not None:
        name = errno.errorcode.get(exc.errno, f"errno {exc.errno}")
        return f"{name} ({exc.strerror or os.strerror(exc.errno)})"
    return f"{type(exc).__name__} ({exc})"


def _unlink(path: str) -> bool:
    return not _unlink_error(path)


def _unlink_error(path: str) -> str:
    """Remove `path`; "" when it is gone (or was never there), else why it could not be removed (logged)."""
    try:
        os.unlink(path)
        return ""
    except FileNotFoundError:
        return ""
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__  # str(exc) would name the path: callers name the file
        log.warning("conversation cache: cannot remove %s: %s", path, reason)
        return reason


class DiskTier:
    """Files of one identity in `folder`; the index lives in `self.index`, guarded by the caller's lock."""

    def __init__(self, parent: str, identity: CacheIdentity, *, engine_version: str) -> None:
        self.parent = parent
        self.folder = os.path.join(parent, identity.key)
        self.identity = identity
        self.engine_version = engine_version
        self.index = TierIndex("disk")
        self._lock_fd: int | None = None
        self.error = ""  # why the folder is unusable (parks are refused with this), empty when fine
        # The last write that failed (a full disk, a folder remounted read-only), until a later one succeeds: the
        # folder stays usable meanwhile (space may come back), so this is not `error`, but GET /metrics shows it.
        self.write_error = ""

    # ------------------------------------------------------------------ folder, lock, start-up index

    def open(self, *, days: float) -> dict[str, int]:
        """Create and lock the folder, then index it from headers; returns counts of what was removed."""
        try:
            os.makedirs(self.folder, exist_ok=True)
        except OSError as exc:
            self.error = f"cannot create cache folder {self.folder}: {exc.strerror or exc}"
            log.error("conversation cache: %s; disk parking is off until it is fixed", self.error)
            return {}
        self._take_lock()
        return self.scan(days=days)

    def _take_lock(self) -> None:
        path = os.path.join(self.folder, LOCK_NAME)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            # A read-only folder: nothing can be written, so there is nothing to protect; parks are refused.
            self.error = f"cannot write in cache folder {self.folder}: {exc.strerror or exc}"
            log.error("conversation cache: %s; disk parking is off until it is fixed", self.error)
            return
        try:
            _lock_file(fd)
        except OSError:
            try:
                other = os.pread(fd, 32, 0).decode(errors="replace").strip() if hasattr(os, "pread") else "?"
            except OSError:
                other = "?"
            os.close(fd)
            raise CacheDirLockedError(
                f"conversation cache folder {self.folder} is in use by another Strata engine (pid {other or '?'}); "
                "stop that engine or give this one another --conversation-cache-dir"
            ) from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0) if hasattr(os, "pwrite") else None
        except OSError:
            pass
        self._lock_fd = fd

    def close(self) -> None:
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                _unlock_file(self._lock_fd)
            os.close(self._lock_fd)
            self._lock_fd = None

    def write_failed(self, what: str, reason: str) -> None:
        """Record a failed write of `what` (`reason`: `os_reason`'s words) with the time it failed, in UTC.
        Caller holds the cache's lock."""
        self.write_error = f"{reason}: writing {what} failed at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}"

    def write_succeeded(self) -> None:
        """A write went through: the disk takes writes again. Caller holds the cache's lock."""
        self.write_error = ""

    def block_path(self, key: str) -> str:
        return os.path.join(self.folder, f"blk-{key}.safetensors")

    def block_file_bytes(self, key: str) -> bytes:
        """A written block's file as it is (what the remote tier stores: the same format); OSError when gone."""
        with open(self.block_path(key), "rb") as f:
            return f.read()

    def conv_path(self, conv_id: str) -> str:
        return os.path.join(self.folder, f"conv-{conv_id}.safetensors")

    def scan(self, *, days: float) -> dict[str, int]:
        """Index the folder from headers only; remove our leftovers and every file that cannot be used."""
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
            names = sorted(os.listdir(self.folder))
        except OSError as exc:
            self.error = f"cannot list cache folder {self.folder}: {exc.strerror or exc}"
            log.error("conversation cache: %s", self.error)
            return removed
        now = time.time()
        blocks: dict[str, tuple[int, bool]] = {}  # key -> (file bytes, holds the checkpoint at its end)
        convs: list[tuple[str, str]] = []
        for done, name in enumerate(names):
            startup_progress.report(done, len(names))  # GET /health shows the fraction while the engine starts
            path = os.path.join(self.folder, name)
            if is_temp_name(name) and OURS_RE.match(name[1 : name.rindex(".tmp-")]):
                if os.path.isfile(path) and _unlink(path):
                    removed["temp"] += 1
                continue
            if not OURS_RE.match(name):
                continue  # not ours: never touched
            if not os.path.isfile(path) or os.path.islink(path):
                log.warning("conversation cache: %s is not a regular file; ignored", path)
                continue
            if days == 0:
                removed["expired"] += _unlink(path)
                continue
            if m := BLOCK_RE.match(name):
                reason, state = self._check_block_file(path, m.group(1))
                if reason:
                    removed[reason] += _unlink(path)
                else:
                    st = os.stat(path)
                    blocks[m.group(1)] = (st.st_size, state)
            elif m := CONV_RE.match(name):
                convs.append((m.group(1), path))
            else:
                removed["malformed"] += _unlink(path)
        loaded: list[Conv] = []
        for conv_id, path in convs:
            try:
                st = os.stat(path)
                conv = self._read_manifest(path, conv_id, st.st_size, st.st_mtime)
                if days and now - conv.last_used > days * DAY:
                    removed["expired"] += _unlink(path)
                    continue
            except FileFormatError as exc:
                log.info("conversation cache: removing %s (%s)", path, exc)
                reason = {"alien": "foreign"}.get(exc.reason, exc.reason)
                removed[reason if reason in removed else "corrupt"] += _unlink(path)
                continue
            except OSError as exc:
                log.info("conversation cache: removing unreadable %s (%s)", path, exc.strerror or exc)
                removed["unreadable"] += _unlink(path)
                continue
            if any(k not in blocks for k in conv.keys):
                removed["incomplete"] += _unlink(path)
                continue
            loaded.append(conv)
        held = {k for conv in loaded for k in conv.keys}
        for key in list(blocks):
            if key not in held:
                removed["orphan"] += _unlink(self.block_path(key))
                del blocks[key]
        for conv in sorted(loaded, key=lambda c: c.last_used):
            new = [Block(k, blocks[k][0], on_disk=True, state=blocks[k][1]) for k in conv.keys
                   if k not in self.index.blocks]
            # the same block may appear twice in one conversation only if keys repeat, which chaining rules out
            self.index.add(conv, new)
        gone = {k: v for k, v in removed.items() if v}
        log.info(
            "conversation cache ready: %d conversations, %d blocks, %.1f MiB on disk (%s)%s",
            len(self.index.convs),
            len(self.index.blocks),
            self.index.bytes / (1 << 20),
            self.folder,
            f"; removed {gone}" if gone else "",
        )
        return removed

    def _check_block_file(self, path: str, key: str) -> tuple[str, bool]:
        """("", holds a checkpoint) when the block file is usable (header only), else (the reason to remove it, _)."""
        try:
            with open(path, "rb", buffering=0) as f:
                header = read_header(f)
            check_identity(header, self.identity, kv_only=False)
            n = self.identity.block_tokens
            state = {s.name for s in self.identity.state_parts}
            names = {s.name for s in self.identity.parts}
            has_state = bool(state) and set(header.tensors) == names | state
            ok = (
                header.meta.get("kind") == "block"
                and header.meta.get("block_key") == key
                and (set(header.tensors) == names or has_state)
                and all(
                    header.tensors[s.name].shape == s.shape(n) and header.tensors[s.name].dtype == s.dtype
                    for s in self.identity.parts + (self.identity.state_parts if has_state else ())
                )
            )
            return ("" if ok else "corrupt"), has_state
        except FileFormatError as exc:
            return ({"alien": "foreign"}.get(exc.reason, exc.reason) if exc.reason in _REASONS else "corrupt"), False
        except OSError:
            return "unreadable", False

    def _read_manifest(self, path: str, conv_id: str, size: int, mtime: float) -> Conv:
        with open(path, "rb", buffering=0) as f:
            header = read_header(f)
            n, n_blocks = check_conversation(header, self.identity, session=False)
            positions = checkpoint_positions(header, self.identity)
            tokens = read_tensor(f, header, "tokens").numpy()
        if header.meta.get("conversation_id") != conv_id:
            raise FileFormatError("corrupt", "conversation id in the header does not match the file name")
        keys = block_keys(self.identity.key, tokens, self.identity.block_tokens)
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

    # ------------------------------------------------------------------ writes

    def manifest_size(self, n_tokens: int, n_checkpoints: int = 0, checkpoint_bytes: int | None = None) -> int:
        """Size of a manifest for `n_tokens` tokens and its own checkpoints (`checkpoint_bytes` together, else
        each of the identity's checkpoint size; headers are padded to a 4096-byte multiple; exact for an
        attention-only model)."""
        n_tail = n_tokens % self.identity.block_tokens
        if checkpoint_bytes is None:
            checkpoint_bytes = n_checkpoints * self.identity.state_bytes
        return self._header_size(n_checkpoints) + 4 * n_tokens + n_tail * self.identity.bytes_per_token + checkpoint_bytes

    def block_size(self, state: bool = False) -> int:
        """Size of a block file (with the checkpoint at its end when `state`)."""
        return self._header_size(1 if state else 0) + self.identity.block_bytes + (
            self.identity.state_bytes if state else 0)

    def _header_size(self, n_checkpoints: int = 0) -> int:
        from engine.cache.fileformat import ALIGN

        # identity JSON plus a generous allowance for the other fields (and ~200 bytes per checkpoint tensor
        # entry), rounded to the payload alignment
        entries = n_checkpoints * len(self.identity.state_parts) * 200
        return -(-(len(str(self.identity.describe())) + 2048 + entries) // ALIGN) * ALIGN

    def write_blocks(self, items, *, sync: bool = True) -> dict[str, int]:
        """Write (key, parts-or-callable) block files atomically; returns {key: file bytes}.

        Temp files are written first and fsynced together, then renamed and the folder fsynced once, so a
        crash leaves whole files or recognisable temps. On error every temp is removed and OSError raised.
        """
        temps: list[tuple[str, str]] = []
        sizes: dict[str, int] = {}
        try:
            for key, data in items:
                parts = data() if callable(data) else data
                header, tensors = block_file(self.identity, key, parts, engine_version=self.engine_version)
                final = self.block_path(key)
                tmp, n = write_temp(final, file_chunks(header, tensors), fsync=False)
                temps.append((tmp, final))
                sizes[key] = n
                del parts, tensors
            if sync:
                for tmp, _ in temps:
                    _fsync_path(tmp)
            publish(temps, sync_dirs=sync)
        except BaseException:
            for tmp, _ in temps:
                if os.path.exists(tmp):
                    _unlink(tmp)
            raise
        return sizes

    def write_manifest(self, conv: Conv, tail: Parts | None, *, history: History | None = None,
                       checkpoints: dict[int, Parts] | None = None) -> int:
        """Write a conversation's manifest atomically (its blocks must be published first); `history` is the
        `Conv.history` to record when not the entry's own (the writer's copy, taken under the lock);
        `checkpoints` its own checkpoints when not held by the entry (read back from its manifest)."""
        last_used, hits, priority, pinned, name, client, system = conv.history if history is None else history
        if checkpoints is None:
            assert all(v is not None for v in conv.checkpoints.values()), "checkpoints only on disk: read them"
            checkpoints = conv.checkpoints  # type: ignore[assignment]
        header, tensors = conversation_file(
            self.identity,
            conv.tokens,
            tail,
            n_blocks=len(conv.keys),
            engine_version=self.engine_version,
            conversation_id=conv.id,
            created=conv.created,
            last_used=last_used,
            hits=hits,
            attrs={"priority": priority, "pinned": "true" if pinned else "false", "name": name, "client": client,
                   "system": system},
            checkpoints=checkpoints,
        )
        final = self.conv_path(conv.id)
        tmp, n = write_temp(final, file_chunks(header, tensors), fsync=True)
        try:
            publish([(tmp, final)])
        except BaseException:
            _unlink(tmp)
            raise
        return n

    def delete_conv(self, conv: Conv, freed: list[Block]) -> int:
        """Remove a dropped conversation's manifest and the block files no one holds any more; returns the bytes
        of the files that could not be removed (they stay until a start-up scan can remove them)."""
        stuck = 0
        if conv.on_disk and _unlink_error(self.conv_path(conv.id)):
            stuck += conv.nbytes
        for blk in freed:
            if blk.on_disk and _unlink_error(self.block_path(blk.key)):
                stuck += blk.nbytes
        return stuck

    def remove_manifest(self, conv: Conv) -> str:
        """Remove a written conversation's manifest (which makes it unrestorable, here and after a restart);
        "" when done, else why not."""
        return _unlink_error(self.conv_path(conv.id)) if conv.on_disk else ""

    def delete_blocks(self, keys: list[str]) -> None:
        """Remove published block files no index entry names (a rolled-back park, an orphaned write)."""
        for key in keys:
            _unlink(self.block_path(key))

    def touch(self, conv: Conv) -> int:
        """Persist a written conversation's last use and hits (a restore, a re-park of the same tokens) so the
        list, LRU order and expiry survive a restart or a crash; returns the change in the manifest's bytes.

        Only the manifest is rewritten (token ids and the partial tail block, read back and verified), atomically
        as every manifest is; the block files are never touched. A failure is logged and leaves the old manifest,
        which is still a valid file: only this use is then forgotten by a restart.
        """
        assert conv.on_disk, (conv.id, conv.state)
        try:
            n = self.write_manifest(conv, self.read_tail(conv), checkpoints=self.read_checkpoints(conv))
        except (OSError, FileFormatError) as exc:
            log.warning("conversation cache: cannot record the use of %s on disk: %s", conv.id, exc)
            return 0
        # the header is padded to 4096 bytes, so a longer hit count can, rarely, change the file's size
        delta, conv.nbytes = n - conv.nbytes, n
        return delta

    # ------------------------------------------------------------------ reads

    def read_block(self, key: str) -> Parts:
        """Every state part of a block, each verified against its checksum and its spec."""
        with open(self.block_path(key), "rb", buffering=0) as f:
            header = read_header(f)
            check_identity(header, self.identity, kv_only=False)
            if header.meta.get("kind") != "block" or header.meta.get("block_key") != key:
                raise FileFormatError("corrupt", f"block file {key[:12]}… holds another block")
            state = self.identity.state_parts if self.identity.state_parts[:1] and (
                self.identity.state_parts[0].name in header.tensors) else ()
            parts = {s.name: read_tensor(f, header, s.name) for s in self.identity.parts + state}
        n = self.identity.block_tokens
        if any(tuple(parts[s.name].shape) != s.shape(n) for s in self.identity.parts):
            raise FileFormatError("corrupt", "a block part has the wrong shape")
        return parts

    def read_tail(self, conv: Conv) -> Parts | None:
        with self._manifest(conv) as (f, header):
            if conv.n_tokens % self.identity.block_tokens == 0:
                return None
            return {s.name: read_tensor(f, header, s.name) for s in self.identity.parts}

    def read_checkpoints(self, conv: Conv, positions: list[int] | None = None) -> dict[int, Parts]:
        """A hybrid conversation's own checkpoints (all, or those at `positions`), each part verified."""
        with self._manifest(conv) as (f, header):
            stored = checkpoint_positions(header, self.identity)
            wanted = stored if positions is None else positions
            if any(p not in stored for p in wanted):
                raise FileFormatError("corrupt", "manifest lacks a checkpoint it was indexed with")
            return {p: {s.name: read_tensor(f, header, checkpoint_tensor(p, s.name)) for s in self.identity.state_parts}
                    for p in wanted}

    @contextlib.contextmanager
    def _manifest(self, conv: Conv):
        """The open manifest of an indexed conversation and its header, checked to be what was indexed."""
        with open(self.conv_path(conv.id), "rb", buffering=0) as f:
            header = read_header(f)
            n, _ = check_conversation(header, self.identity, session=False)
            if n != conv.n_tokens or header.meta.get("conversation_id") != conv.id:
                raise FileFormatError("corrupt", "manifest changed on disk since it was indexed")
            tokens = read_tensor(f, header, "tokens").numpy()
            if not np.array_equal(tokens, conv.tokens):
                raise FileFormatError("corrupt", "manifest token ids changed on disk since it was indexed")
            yield f, header


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


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDWR | getattr(os, "O_BINARY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


if os.name == "nt":  # pragma: no cover - exercised on Windows only
    import msvcrt

    def _lock_file(fd: int) -> None:
        msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)  # type: ignore[attr-defined]  # Windows-only names

    def _unlock_file(fd: int) -> None:
        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)  # type: ignore[attr-defined]

else:
    import fcntl

    def _lock_file(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def _unlock_file(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_UN)
