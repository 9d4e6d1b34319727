"""What the listing and a purge report match what is really on disk: read-only folders, RAM-only entries."""

from __future__ import annotations

import os

import pytest

from tests.test_cache_disk import _in_child, folder_of, our_files
from tests.test_cache_support import BLOCK, LAYOUT, FakeSlots, conversation, make_cache, park_tokens

BPT = LAYOUT.bytes_per_token


def test_purge_on_a_read_only_folder_reports_what_it_could_not_remove():
    import shutil
    import tempfile
    from pathlib import Path

    if os.geteuid() != 0:
        pytest.skip("needs root to switch to an unprivileged user for the read-only folder")
    tmp_path = Path(tempfile.mkdtemp(prefix="strata-ro-purge-"))  # pytest's tmp_path is not reachable by nobody
    try:
        slots = FakeSlots()
        cache = make_cache(storage="disk", dir=str(tmp_path))
        convs = [conversation(140 + i, 3 * BLOCK + i) for i in range(3)]
        ids = sorted(park_tokens(cache, slots, t).conversation_id for t in convs)
        assert cache.flush(10)
        folder = folder_of(cache)
        cache.close(spill=False)
        before = our_files(folder)
        os.chmod(tmp_path, 0o755)
        os.chmod(folder, 0o555)  # nobody can read it, not change it

        def purge_read_only() -> bool:
            os.setgid(65534)
            os.setuid(65534)
            c = make_cache(storage="disk", dir=str(tmp_path))
            result = c.purge("disk")
            listed = sorted(x.id for x in c.conversations())
            return (
                result.dropped == 0
                and result.bytes == 0
                and sorted(cid for cid, _ in result.skipped) == ids
                and all("cannot be removed" in why and "Permission denied" in why for _, why in result.skipped)
                # the file by its name in the cache folder: the folder's path is the operator's, not the client's
                and all(f"conv-{cid}.safetensors" in why and str(tmp_path) not in why for cid, why in result.skipped)
                and listed == ids  # still parked: they would come back at the next start anyway
            )

        assert _in_child(purge_read_only) == 0
        assert our_files(folder) == before
        os.chmod(folder, 0o755)
        again = make_cache(storage="disk", dir=str(tmp_path))
        result = again.purge("disk")
        assert result.dropped == 3 and result.skipped == [] and our_files(folder) == []
        again.close(spill=False)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)


def test_listing_says_which_conversations_are_on_disk(tmp_path):
    conv_bytes = 4 * BLOCK * BPT
    cache = make_cache(storage="tiered", dir=str(tmp_path), ram_bytes=conv_bytes + 4096)
    slots = FakeSlots()
    first, second = conversation(150, 4 * BLOCK), conversation(151, 4 * BLOCK)
    park_tokens(cache, slots, first)
    with cache.lock:  # hold the writer back: the spill of `first` stays pending
        park_tokens(cache, slots, second)  # RAM holds one: `first` is evicted and spilled
        rows = {r.tier: r for r in cache.conversations()}
        assert (rows["ram"].on_disk, rows["disk"].on_disk, rows["disk"].pending) == (False, False, True)
    assert cache.flush(10)
    rows = {r.tier: r for r in cache.conversations()}
    assert rows["disk"].on_disk and not rows["disk"].pending and not rows["ram"].on_disk
    assert rows["disk"].to_dict()["on_disk"] is True
    cache.close(spill=False)
