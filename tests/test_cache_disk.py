"""The disk tier and tiered mode: files, restarts, start-up index, budgets, spills, purge, reconfigure, locking."""

from __future__ import annotations

import gc
import json
import os
import struct
import time

import psutil
import pytest
import torch

from engine.cache import CacheDirLockedError, CacheRestoreError, ConversationCache
from engine.kv import KVLayout
from tests.cache_faults import (
    SPAWN,
    no_file_size_limit_on_windows,
    run_child,
)
from tests.test_cache_support import (
    BLOCK,
    LAYOUT,
    FakeSlots,
    conversation,
    identity,
    make_cache,
    park_tokens,
)

BPT = LAYOUT.bytes_per_token


def folder_of(cache: ConversationCache) -> str:
    return cache.stats().dir


def our_files(folder: str) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))


def check_restores(cache, slots, tokens, slot=1):
    hit = cache.lookup(tokens + [7])
    assert hit is not None and hit.n_tokens == len(tokens), hit
    slots.kv.clear(slot)
    cache.restore(hit, slots.writer(slot))
    slots.fill(0, tokens)
    assert torch.equal(slots.kv.read(slot, 0, len(tokens)), slots.snapshot(0, len(tokens)))
    return hit


def test_disk_park_restores_byte_identical_and_shares_block_files(tmp_path):
    cache, slots = make_cache(storage="disk", dir=str(tmp_path)), FakeSlots()
    system = conversation(1, 6 * BLOCK)
    a, b = conversation(2, 9 * BLOCK + 3, system), conversation(3, 8 * BLOCK + 11, system)
    park_tokens(cache, slots, a)
    park_tokens(cache, slots, b)
    assert cache.flush(10)  # parks return before their files are written
    folder = folder_of(cache)
    files = our_files(folder)
    assert (
        sum(f.startswith("blk-") for f in files) == 6 + 3 + 2
        and sum(f.startswith("conv-") for f in files) == 2
    )
    st = cache.stats()
    assert st.bytes_ram == 0 and st.entries_disk == 2
    assert st.bytes_disk == sum(os.path.getsize(os.path.join(folder, f)) for f in files)  # counts file bytes
    check_restores(cache, slots, a)
    check_restores(cache, slots, b)
    assert all(c.tier == "disk" for c in cache.conversations())
    cache.close(spill=True)


def test_disk_incremental_repark_writes_only_new_blocks(tmp_path):
    cache, slots = make_cache(storage="disk", dir=str(tmp_path)), FakeSlots()
    tokens = conversation(4, 20 * BLOCK + 5)
    first = park_tokens(cache, slots, tokens)
    grown = conversation(5, len(tokens) + 10, tokens)
    second = park_tokens(cache, slots, grown)
    assert second.conversation_id == first.conversation_id
    assert second.new_bytes < 2 * (BLOCK * BPT + 8192) + 4 * len(grown) + (len(grown) % BLOCK) * BPT
    assert cache.flush(10)
    assert len([f for f in our_files(folder_of(cache)) if f.startswith("conv-")]) == 1
    check_restores(cache, slots, grown)
    cache.close(spill=False)


def test_restart_finds_parked_conversations_and_restores_them(tmp_path):
    slots = FakeSlots()
    convs = [conversation(10 + i, 5 * BLOCK + 3 * i) for i in range(3)]
    for mode in ("disk", "tiered"):
        cache = make_cache(storage=mode, dir=str(tmp_path / mode))
        ids = [park_tokens(cache, slots, t).conversation_id for t in convs]
        cache.close(spill=True)
        again = make_cache(storage=mode, dir=str(tmp_path / mode))
        assert sorted(c.id for c in again.conversations()) == sorted(ids)
        for t in convs:
            assert check_restores(again, slots, t).tier == "disk"
        again.close(spill=True)


def test_disk_park_keeps_no_kv_resident(tmp_path):
    """RSS after a disk park grows by at most the staging bound (spill_queue_bytes), whatever the size."""
    layout = KVLayout(n_layers=8, n_kv_heads=8, head_dim=64, dtype=torch.float32)  # 32 KiB per token
    ident = identity(layout=layout, block=64)
    n = 200 * (1 << 20) // layout.bytes_per_token
    slots = FakeSlots(layout, n_slots=1, ctx=n)
    for stage in slots.kv.stages:
        stage.k.normal_()
        stage.v.normal_()
    bound = 16 << 20
    cache = make_cache(ident, storage="disk", dir=str(tmp_path), disk_bytes=1 << 30, spill_queue_bytes=bound)
    tokens = conversation(20, n)
    gc.collect()
    rss = psutil.Process().memory_info().rss
    result = cache.park(tokens, slots.reader(0))  # larger than the bound: streamed to its files
    gc.collect()
    grew = psutil.Process().memory_info().rss - rss
    assert result.parked and result.new_bytes >= 200 << 20
    assert grew < bound + (16 << 20), f"RSS grew by {grew / 2**20:.1f} MiB"
    st = cache.stats()
    assert st.bytes_ram == 0 and st.bytes_pending == 0 and cache.conversations()[0].pending is False
    # a park that fits the bound is staged: held in RAM (at most the bound) only until written
    small = conversation(21, (6 << 20) // layout.bytes_per_token)
    slots.fill(0, small)
    staged = cache.park(small, slots.reader(0))
    assert staged.parked and 0 < cache.stats().bytes_pending <= bound
    assert cache.flush(30)
    st = cache.stats()
    assert st.bytes_ram == 0 and st.bytes_pending == 0
    assert all(blk.data is None and blk.on_disk for blk in cache.disk.index.blocks.values())
    assert all(c.tail is None and c.on_disk for c in cache.disk.index.convs.values())
    cache.close(spill=False)


def _rewrite_header(path: str, change) -> None:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        payload = f.read()
    change(header)
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % 4096)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + payload)


def test_startup_index_keeps_good_files_and_removes_only_bad_files_of_ours(tmp_path, caplog):
    slots = FakeSlots()
    cache = make_cache(storage="disk", dir=str(tmp_path))
    good = [conversation(30 + i, 3 * BLOCK + 5) for i in range(5)]
    ids = [park_tokens(cache, slots, t).conversation_id for t in good]
    folder = folder_of(cache)
    assert cache.flush(10)
    old = time.time() - 40 * 86400
    aged = cache.disk.index.convs[ids[3]]
    aged.created = aged.last_used = old  # expired: its manifest says it was last used 40 days ago
    cache.disk.record_use(aged)
    cache.close(spill=False)
    # a foreign model's file, copied in under our naming
    foreign = make_cache(identity({"architecture": "qwen2"}), storage="disk", dir=str(tmp_path / "f"))
    park_tokens(foreign, slots, conversation(39, 2 * BLOCK + 1))
    ffolder = folder_of(foreign)
    foreign.close(spill=False)
    for name in our_files(ffolder):
        os.replace(os.path.join(ffolder, name), os.path.join(folder, name))
    conv = lambda cid: os.path.join(folder, f"conv-{cid}.safetensors")  # noqa: E731
    with open(conv(ids[0]), "r+b") as f:  # corrupt header byte
        f.seek(40)
        f.write(b"#")
    with open(conv(ids[1]), "r+b") as f:  # truncated
        f.truncate(os.path.getsize(conv(ids[1])) - 10)
    _rewrite_header(conv(ids[2]), lambda h: h["__metadata__"].update(format_version="0"))
    extra = {
        "conv-hacked-9.safetensors": b"x",
        ".conv-0123456789abcdef.safetensors.tmp-1-0badc0de": b"partial",
        "notes.txt": b"mine",
        "conv-1.txt": b"also mine",
        "blk-not-ours.bin": b"keep",
    }
    for name, data in extra.items():
        with open(os.path.join(folder, name), "wb") as f:
            f.write(data)
    os.mkdir(os.path.join(folder, "blk-" + "0" * 32 + ".safetensors"))
    with caplog.at_level("INFO", logger="strata.cache"):
        again = make_cache(storage="disk", dir=str(tmp_path))
    assert [c.id for c in again.conversations()] == [ids[4]]
    check_restores(again, slots, good[4])
    left = sorted(os.listdir(folder))
    assert {"notes.txt", "conv-1.txt", "blk-not-ours.bin", "blk-" + "0" * 32 + ".safetensors"} <= set(left)
    assert "conv-hacked-9.safetensors" not in left and not any(".tmp-" in n for n in left)
    held = {f"blk-{k}.safetensors" for k in again.disk.index.blocks}
    assert {
        n for n in left if n.startswith("blk-") and n.endswith(".safetensors") and "0" * 32 not in n
    } == held
    assert "conversation cache ready: 1 conversations, 3 blocks" in caplog.text
    again.close(spill=False)
    # days = 0 empties the folder of our files, and only of ours
    emptied = make_cache(storage="disk", dir=str(tmp_path), days=0)
    assert emptied.conversations() == [] and "notes.txt" in os.listdir(folder)
    assert [n for n in os.listdir(folder) if CONV_OR_BLK(n)] == ["blk-" + "0" * 32 + ".safetensors"]
    emptied.close(spill=False)


def CONV_OR_BLK(name: str) -> bool:  # noqa: N802
    return name.endswith(".safetensors") and name.startswith(("conv-", "blk-"))


def test_corrupt_block_is_never_restored_and_the_slot_is_untouched(tmp_path):
    cache, slots = make_cache(storage="disk", dir=str(tmp_path)), FakeSlots()
    shared = conversation(40, 4 * BLOCK)
    a, b = conversation(41, 8 * BLOCK, shared), conversation(42, 7 * BLOCK, shared)
    park_tokens(cache, slots, a)
    park_tokens(cache, slots, b)
    assert cache.flush(10)
    folder = folder_of(cache)
    first_block = sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.startswith("blk-"))
    idx = cache.disk.index
    shared_key = [k for k in idx.blocks if len(idx.blocks[k].holders) == 2][0]
    path = os.path.join(folder, f"blk-{shared_key}.safetensors")
    assert path in first_block
    with open(path, "r+b") as f:
        f.seek(-7, os.SEEK_END)
        byte = f.read(1)
        f.seek(-7, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x40]))
    slots.fill(1, conversation(43, 100))
    before = slots.snapshot(1, 200)
    hit = cache.lookup(a + [1])
    calls: list = []
    with pytest.raises(CacheRestoreError, match="damaged"):
        cache.restore(hit, slots.writer(1, calls))
    assert calls == [] and torch.equal(slots.snapshot(1, 200), before)
    assert cache.conversations() == []  # both holders of the damaged block are gone, files too
    assert our_files(folder) == []
    assert park_tokens(cache, slots, a).parked
    check_restores(cache, slots, a)
    cache.close(spill=False)


def test_disk_budget_is_a_ceiling_on_file_bytes(tmp_path):
    budget = 700_000
    cache, slots = make_cache(storage="disk", dir=str(tmp_path), disk_bytes=budget), FakeSlots()
    for i in range(12):
        assert park_tokens(cache, slots, conversation(50 + i, 4 * BLOCK + i)).parked
        assert cache.flush(10)
        folder = folder_of(cache)
        on_disk = sum(os.path.getsize(os.path.join(folder, n)) for n in our_files(folder))
        assert on_disk <= budget and cache.stats().bytes_disk == on_disk
    assert cache.stats().evictions > 0
    refused = park_tokens(cache, slots, conversation(70, 200 * BLOCK))
    assert not refused.parked and refused.reason == "larger_than_budget"
    cache.close(spill=False)


def test_tiered_spills_evictions_in_the_background_and_everything_on_close(tmp_path):
    conv_bytes = 6 * BLOCK * BPT
    cache = make_cache(storage="tiered", dir=str(tmp_path), ram_bytes=int(2.5 * conv_bytes))
    slots = FakeSlots()
    convs = [conversation(80 + i, 6 * BLOCK) for i in range(6)]
    for t in convs:
        assert park_tokens(cache, slots, t).tier == "ram"
    st = cache.stats()
    assert st.entries_ram == 2 and st.evictions == 4
    for t in convs:  # evicted ones come back from disk (or from their RAM copy while still being written)
        hit = cache.lookup(t + [1])
        assert hit is not None and hit.n_tokens == len(t)
    cache.close(spill=True)
    reopened = make_cache(storage="disk", dir=str(tmp_path))
    assert len(reopened.conversations()) == 6
    for t in convs:
        check_restores(reopened, slots, t)
    reopened.close(spill=False)


def test_tiered_spill_queue_is_bounded(tmp_path):
    conv_bytes = 6 * BLOCK * BPT
    cache = make_cache(storage="tiered", dir=str(tmp_path), ram_bytes=conv_bytes + 4096, spill_queue_bytes=0)
    slots = FakeSlots()
    with cache.lock:  # hold the writer back: every spill stays pending
        for i in range(4):
            park_tokens(cache, slots, conversation(90 + i, 6 * BLOCK))
        st = cache.stats()
    assert st.spill_dropped >= 2 and st.bytes_pending <= conv_bytes + 4 * 6 * BLOCK
    cache.close(spill=True)


def test_purge_per_tier_counts_and_removes_files(tmp_path):
    cache = make_cache(storage="tiered", dir=str(tmp_path), ram_bytes=3 * 4 * BLOCK * BPT)
    slots = FakeSlots()
    for i in range(5):
        park_tokens(cache, slots, conversation(100 + i, 4 * BLOCK))
    assert cache.flush(10)
    st = cache.stats()
    assert (st.entries_ram, st.entries_disk) == (2, 3)
    ram = cache.purge("ram")
    assert ram.dropped == 2 and ram.bytes == st.bytes_ram and ram.skipped == []
    disk = cache.purge("disk")
    assert disk.dropped == 3 and disk.bytes == st.bytes_disk
    assert our_files(folder_of(cache)) == []
    assert cache.purge("all").dropped == 0
    cache.close(spill=True)


def test_reconfigure_moves_conversations_without_losing_any(tmp_path):
    slots = FakeSlots()
    cache = make_cache(storage="ram")
    convs = [conversation(110 + i, 3 * BLOCK + i) for i in range(3)]
    for t in convs:
        park_tokens(cache, slots, t)
    changed = cache.reconfigure(cache.settings.replace(storage="disk", dir=str(tmp_path / "a")))
    assert changed == ["storage", "dir"]
    st = cache.stats()
    assert (st.entries_ram, st.entries_disk, st.bytes_ram) == (0, 3, 0)
    for t in convs:
        assert check_restores(cache, slots, t).tier == "disk"
    cache.reconfigure(cache.settings.replace(dir=str(tmp_path / "b")))  # a new folder: moved, then indexed
    assert (
        len(cache.conversations()) == 3
        and our_files(os.path.join(str(tmp_path / "a"), cache.identity.key)) == []
    )
    cache.reconfigure(cache.settings.replace(storage="tiered"))
    for t in convs:
        check_restores(cache, slots, t)
    cache.reconfigure(cache.settings.replace(disk_bytes=2 * (3 * BLOCK * BPT + 3 * 8192)))  # shrinking evicts
    assert cache.stats().entries_disk < 3 and cache.stats().evictions > 0
    with pytest.raises(ValueError, match="block_tokens"):
        cache.reconfigure(cache.settings.replace(block_tokens=2 * BLOCK))
    cache.close(spill=True)


def test_two_caches_on_one_folder_are_refused_clearly(tmp_path):
    first = make_cache(storage="disk", dir=str(tmp_path))
    with pytest.raises(CacheDirLockedError, match="in use by another Strata engine"):
        make_cache(storage="disk", dir=str(tmp_path))
    assert run_child(_refused_here, str(tmp_path), method=SPAWN)[0] == 0  # another process is refused too
    other_model = make_cache(
        identity({"architecture": "other"}), storage="disk", dir=str(tmp_path)
    )  # own folder
    first.close(spill=False)
    make_cache(storage="disk", dir=str(tmp_path)).close(spill=False)
    other_model.close(spill=False)


def _refused_here(_report, folder: str) -> int:
    """In a child: 0 when the cache folder is refused as in use, 1 when it is not."""
    try:
        make_cache(storage="disk", dir=folder)
    except CacheDirLockedError:
        return 0
    return 1


def test_unusable_folder_refuses_parks_with_a_clear_log(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache folder should be")
    cache, slots = make_cache(storage="disk", dir=str(blocker)), FakeSlots()
    with caplog.at_level("WARNING", logger="strata.cache"):
        result = park_tokens(cache, slots, conversation(120, 40))
    assert not result.parked and result.reason == "disk_unavailable"
    assert "cannot create cache folder" in caplog.text and cache.stats().disk_error
    cache.close(spill=True)


def _in_child(fn) -> int:
    """Run `fn` in a forked child; returns its exit status (0 = fn returned True). POSIX only: `fn` is a closure
    that changes the child's process limits or user, which only tests of POSIX mechanisms do."""
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            torch.set_num_threads(1)
            code = 0 if fn() else 1
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@no_file_size_limit_on_windows
def test_write_failure_and_read_only_folder_refuse_the_park_and_keep_what_is_on_disk():
    import resource
    import shutil
    import signal
    import tempfile
    from pathlib import Path

    tmp_path = Path(
        tempfile.mkdtemp(prefix="strata-ro-")
    )  # pytest's tmp_path is not reachable by another user
    try:
        _write_failure_and_read_only(tmp_path, resource, signal)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)


def _write_failure_and_read_only(tmp_path, resource, signal):
    slots = FakeSlots()
    kept = conversation(130, 5 * BLOCK + 2)
    cache = make_cache(storage="disk", dir=str(tmp_path))
    ids = [park_tokens(cache, slots, kept).conversation_id]
    folder = folder_of(cache)
    cache.close(spill=False)
    before = {n: os.path.getsize(os.path.join(folder, n)) for n in our_files(folder)}

    def disk_full() -> bool:
        c = make_cache(storage="disk", dir=str(tmp_path))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (6000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        # the park itself returns at once; its background write fails, is counted and dropped
        r = park_tokens(c, slots, conversation(131, 9 * BLOCK))
        written = c.flush(10)
        st = c.stats()
        # a park bigger than the staging bound is written before returning: refused on the spot
        big = make_cache(storage="disk", dir=str(tmp_path / "big"), spill_queue_bytes=0)
        rb = park_tokens(big, slots, conversation(133, 9 * BLOCK))
        return (
            r.parked
            and not written
            and st.spill_failed == 1
            and [x.id for x in c.conversations()] == ids
            and not rb.parked
            and rb.reason == "disk_error"
        )

    def read_only() -> bool:
        os.setgid(65534)
        os.setuid(65534)
        c = make_cache(storage="disk", dir=str(tmp_path))
        r = park_tokens(c, slots, conversation(132, 9 * BLOCK))
        hit = c.lookup(kept + [1])
        return (
            not r.parked and r.reason == "disk_unavailable" and hit is not None and hit.n_tokens == len(kept)
        )

    assert _in_child(disk_full) == 0
    if os.geteuid() == 0:
        os.chmod(tmp_path, 0o755)
        assert _in_child(read_only) == 0
    after = {n: os.path.getsize(os.path.join(folder, n)) for n in our_files(folder)}
    assert after == before and not any(".tmp-" in n for n in os.listdir(folder))
    again = make_cache(storage="disk", dir=str(tmp_path))
    check_restores(again, slots, kept)
    again.close(spill=False)


def test_spill_that_evicts_a_conversation_sharing_its_blocks_keeps_those_blocks(tmp_path):
    cache = make_cache(storage="tiered", dir=str(tmp_path), slots=1)
    slots = FakeSlots()
    prefix = conversation(1, 3 * BLOCK)
    x = prefix + conversation(2, 2 * BLOCK)
    y = prefix + conversation(3, 2 * BLOCK)
    park_tokens(cache, slots, x)
    park_tokens(cache, slots, y)  # one RAM slot: x is evicted and spilled, sharing the prefix blocks with y
    assert cache.flush(30)  # x is written (a write in flight would pin it)
    cache.close(spill=True)  # y spills; one disk slot: x goes, the prefix blocks y reuses must stay
    reopened = make_cache(storage="disk", dir=str(tmp_path), slots=1)
    assert [c.tokens for c in reopened.conversations()] == [len(y)]
    check_restores(reopened, slots, y)
    reopened.close(spill=False)


def test_a_damaged_header_length_is_called_damage_not_a_cut_file(tmp_path):
    from engine.cache.fileformat import FileFormatError, read_header

    cache, slots = make_cache(storage="disk", dir=str(tmp_path)), FakeSlots()
    park_tokens(cache, slots, conversation(44, 2 * BLOCK))
    assert cache.flush(10)
    cache.close(spill=False)
    folder = folder_of(cache)
    path = os.path.join(folder, sorted(n for n in os.listdir(folder) if n.startswith("blk-"))[0])
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(0)
        f.write(struct.pack("<Q", n + 65536 + 3))  # past the file's end, and off the 4096-byte boundary
    with open(path, "rb") as f, pytest.raises(FileFormatError, match="the length is damaged") as info:
        read_header(f)
    assert info.value.reason == "corrupt"
    with open(path, "r+b") as f:
        f.write(struct.pack("<Q", n + 65536))  # past the end on the boundary: a cut file, or a damaged length
    with open(path, "rb") as f, pytest.raises(FileFormatError, match="cut short, or its length field damaged"):
        read_header(f)
