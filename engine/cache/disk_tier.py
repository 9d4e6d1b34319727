"""The disk tier's files: one folder per identity, shared block files, conversation manifests, a lock file.

The tier writes, reads and removes its files here; what their names look like and the file-system calls behind them
are in disk_files.py, the start-up scan that indexes a folder from their headers in disk_scan.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

import numpy as np

from engine.atomic import publish, write_temp
from engine.cache.disk_files import (
    LOCK_NAME,
    block_name,
    conv_name,
    fsync_path,
    lock_file,
    unlink,
    unlink_error,
    unlock_file,
)
from engine.cache.disk_scan import scan_folder
from engine.cache.errors import CacheDirLockedError
from engine.cache.fileformat import FileFormatError, file_chunks, read_header, read_tensor
from engine.cache.identity import CacheIdentity
from engine.cache.index import Block, Conv, History, TierIndex
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
            lock_file(fd)
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
                unlock_file(self._lock_fd)
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
        return os.path.join(self.folder, block_name(key))

    def block_file_bytes(self, key: str) -> bytes:
        """A written block's file as it is (what the remote tier stores: the same format); OSError when gone."""
        with open(self.block_path(key), "rb") as f:
            return f.read()

    def conv_path(self, conv_id: str) -> str:
        return os.path.join(self.folder, conv_name(conv_id))

    def scan(self, *, days: float) -> dict[str, int]:
        """Index the folder from headers only; remove our leftovers and every file that cannot be used."""
        removed, error = scan_folder(self.folder, self.identity, self.index, days=days)
        if error:
            self.error = error
        return removed

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
                    fsync_path(tmp)
            publish(temps, sync_dirs=sync)
        except BaseException:
            for tmp, _ in temps:
                if os.path.exists(tmp):
                    unlink(tmp)
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
            unlink(tmp)
            raise
        return n

    def delete_conv(self, conv: Conv, freed: list[Block]) -> int:
        """Remove a dropped conversation's manifest and the block files no one holds any more; returns the bytes
        of the files that could not be removed (they stay until a start-up scan can remove them)."""
        stuck = 0
        if conv.on_disk and unlink_error(self.conv_path(conv.id)):
            stuck += conv.nbytes
        for blk in freed:
            if blk.on_disk and unlink_error(self.block_path(blk.key)):
                stuck += blk.nbytes
        return stuck

    def remove_manifest(self, conv: Conv) -> str:
        """Remove a written conversation's manifest (which makes it unrestorable, here and after a restart);
        "" when done, else why not."""
        return unlink_error(self.conv_path(conv.id)) if conv.on_disk else ""

    def delete_blocks(self, keys: list[str]) -> None:
        """Remove published block files no index entry names (a rolled-back park, an orphaned write)."""
        for key in keys:
            unlink(self.block_path(key))

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

