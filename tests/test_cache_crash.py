"""kill -9 at seeded points of the park, spill, purge, reconfigure and shutdown paths: nothing published is lost,
nothing half-written is adopted.

Each trial starts a child process (tests/cache_faults.py: spawned as on Windows, or forked where the platform
can) that runs a seeded program of cache steps on its own folder and reports over a pipe what it parked, when
each step starts and, when it ends, which conversations have their files published. The child kills itself at a
seeded fault point (inside a write, a rename, a folder fsync or a removal) counted only inside the steps the
trial is about. A fresh cache on the folder must then hold only whole, valid files, no temp
file, and conversations that the interrupted step allows: a step that only adds (a park, a ram -> disk change,
a shutdown's spill, a start-up scan) keeps everything listed before it; a step that only removes (a purge, a
budget shrink) brings nothing back that was gone; every conversation found restores byte-identical.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable

import pytest

from engine.atomic import is_temp_name
from engine.cache.disk_files import BLOCK_RE, CONV_RE
from engine.cache.fileformat import FileFormatError, read_header, read_tensor
from tests.cache_faults import FAST, SPAWN, arm_fault_points, crashed, run_child
from tests.test_cache_disk import check_restores, folder_of
from tests.test_cache_support import BLOCK, LAYOUT, FakeSlots, conversation, identity, make_cache, park_tokens

BPT = LAYOUT.bytes_per_token
ADDS = {"park", "to_disk", "close", "open"}  # steps that may write files but must remove none that is listed
REMOVES = {"purge", "shrink"}  # steps that may remove files but must publish nothing new
KINDS = {  # the steps a trial of each kind kills in
    "purge": {"purge"},
    "reconfigure": {"to_disk", "to_ram", "shrink"},
    "shutdown": {"close", "open"},
}


class Reporter:
    """The child's side of the pipe: one line per report, each a single write."""

    def __init__(self, report: Callable[[str], None]) -> None:
        self.report = report
        self.step = ""

    def send(self, *message) -> None:
        self.report(json.dumps(message) + "\n")

    def start(self, step: str) -> None:
        self.step = step
        self.send("step", step)

    def done(self, cache, listed: list[str] | None = None) -> None:
        """The step ended: report the conversations whose files are published (the folder's own state)."""
        self.step = ""
        if listed is None:
            listed = [c.id for c in cache.conversations() if c.tier == "disk" and c.on_disk]
        self.send("listed", listed)


def _park_some(cache, slots, rep: Reporter, rng: random.Random, seeds, n: int, *, flush: bool = True) -> None:
    rep.start("park")
    for _ in range(n):
        toks = conversation(next(seeds), rng.randrange(1, 6) * BLOCK + rng.randrange(BLOCK))
        r = park_tokens(cache, slots, toks)
        assert r.parked, r
        rep.send("parked", r.conversation_id, toks)
    if flush:
        assert cache.flush(30)


def _program(kind: str, mode: str, folder: str, rep: Reporter, rng: random.Random) -> None:
    """Run cycles of the trial's kind until the fault point kills the process."""
    slots = FakeSlots()
    seeds = iter(range(10_000_000 + rng.randrange(1 << 20) * 100, 1 << 62))
    big = {"disk_bytes": 1 << 30, "slots": 100_000}
    if kind == "purge":
        cache = make_cache(storage=mode, dir=folder, ram_bytes=8 * BLOCK * BPT, **big)
        for _ in range(500):
            _park_some(cache, slots, rep, rng, seeds, rng.randint(1, 4))
            rep.done(cache)
            rep.start("purge")
            result = cache.purge(rng.choice(["disk", "all"]))
            assert result.skipped == [], result
            rep.done(cache)
            assert [c for c in cache.conversations() if c.tier == "disk"] == []
    elif kind == "reconfigure":
        cache = make_cache(storage="ram", dir=folder, ram_bytes=64 << 20, **big)
        for _ in range(500):
            _park_some(cache, slots, rep, rng, seeds, rng.randint(1, 3))  # in RAM
            rep.start("to_disk")  # ram -> disk: the folder is opened (scanned) and every RAM conversation written
            cache.reconfigure(cache.settings.replace(storage="disk"))
            rep.done(cache)
            _park_some(cache, slots, rep, rng, seeds, 1)
            rep.done(cache)
            rep.start("shrink")  # a smaller disk budget evicts the least recently used
            cache.reconfigure(cache.settings.replace(disk_bytes=max(cache.stats().bytes_disk // 2, 1)))
            rep.done(cache)
            cache.reconfigure(cache.settings.replace(disk_bytes=1 << 30))
            rep.start("to_ram")  # disk -> ram: the files stay for the next disk use
            cache.reconfigure(cache.settings.replace(storage="ram"))
            rep.done(cache, manifests_in(folder))  # not indexed any more, still published
    else:  # shutdown: a tiered close spills RAM, a disk close lands the pending writes; then a restart
        for _ in range(500):
            rep.start("open")
            cache = make_cache(storage=mode, dir=folder, ram_bytes=64 << 20, **big)
            rep.done(cache)
            _park_some(cache, slots, rep, rng, seeds, rng.randint(1, 4), flush=False)
            rep.start("close")
            cache.close(spill=True)
            rep.done(cache)


def manifests_in(folder: str) -> list[str]:
    """Conversations whose manifests are in the folder (the cache no longer indexes it: disk storage is off)."""
    sub = os.path.join(folder, identity().key)
    return sorted(m.group(1) for n in os.listdir(sub) if (m := CONV_RE.match(n)))


def _trial_child(report: Callable[[str], None], kind: str, mode: str, folder: str, seed: int) -> int:
    """The child of one trial: runs its program until the fault point kills it."""
    rng = random.Random(seed)
    target = rng.randrange(40)
    rep = Reporter(report)
    arm_fault_points(target, lambda: rep.step in KINDS[kind], unlinks=True)
    _program(kind, mode, folder, rep, rng)
    return 3  # reached only when the fault point was never hit


def _run_child(kind: str, mode: str, folder: str, seed: int, method: str = FAST) -> list[list]:
    """Start the child for one trial; returns its reports once it was killed."""
    status, lines = run_child(_trial_child, kind, mode, folder, seed, method=method)
    assert crashed(status), (kind, mode, seed, status)
    assert all(line.endswith("\n") for line in lines)  # each report is one write
    return [json.loads(line) for line in lines]


def _check_after_kill(kind: str, reports: list[list], folder: str) -> bool:
    """A fresh cache on the folder holds what the interrupted step allows, all of it whole; True when the kill
    left a temp file behind (it landed inside a write)."""
    parked: dict[str, list[int]] = {}
    listed: set[str] = set()
    step = ""
    for report in reports:
        if report[0] == "parked":
            parked[report[1]] = report[2]
        elif report[0] == "step":
            step = report[1]
        else:
            listed, step = set(report[1]), ""
    assert step in KINDS[kind], (kind, step)  # the kill landed inside a step of this trial's kind
    sub = os.path.join(folder, identity().key)
    torn = any(is_temp_name(n) for n in os.listdir(sub))
    for name in os.listdir(sub):  # the kill left no half file under a real name: each one is whole
        if BLOCK_RE.match(name) or CONV_RE.match(name):
            assert _whole(os.path.join(sub, name)), name
    cache = make_cache(storage="disk", dir=folder, disk_bytes=1 << 30, slots=100_000)
    try:
        names = os.listdir(sub)
        assert not any(is_temp_name(n) for n in names), names
        index = cache.disk.index
        # every file left under our names is indexed, and every indexed file is whole (checksums verified)
        assert {m.group(1) for n in names if (m := BLOCK_RE.match(n))} == set(index.blocks)
        assert {m.group(1) for n in names if (m := CONV_RE.match(n))} == set(index.convs)
        for key in index.blocks:
            cache.disk.files.read_block(key)
        for conv in index.convs.values():
            cache.disk.files.read_tail(conv)
        found = set(index.convs)
        assert found <= set(parked), found - set(parked)  # nothing adopted that the child did not park
        for cid in found:
            assert index.convs[cid].tokens.tolist() == parked[cid]
        if step in ADDS:
            assert listed <= found, (step, listed - found)  # nothing published is lost
        if step in REMOVES:
            assert found <= listed, (step, found - listed)  # nothing removed comes back
        if step == "to_ram":
            assert found == listed, (found ^ listed)
        slots = FakeSlots()
        for cid in sorted(found):
            check_restores(cache, slots, parked[cid])  # byte-identical to what the child parked
    finally:
        cache.close(spill=False)
    return torn


def _whole(path: str) -> bool:
    """Every tensor of the file is there and matches its checksum."""
    try:
        with open(path, "rb", buffering=0) as f:
            header = read_header(f, os.path.getsize(path))
            for name in header.tensors:
                read_tensor(f, header, name)
    except FileFormatError:
        return False
    return True


def _trials(tmp_path, n: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    torn: dict[str, int] = dict.fromkeys(KINDS, 0)
    for trial in range(n):
        kind = list(KINDS)[trial % len(KINDS)]
        mode = "disk" if (trial // len(KINDS)) % 2 == 0 else "tiered"
        folder = str(tmp_path / f"t{trial}")
        # The first child starts as on Windows, in a fresh interpreter; forking the others keeps the test quick.
        reports = _run_child(kind, mode, folder, rng.randrange(1 << 30), SPAWN if trial == 0 else FAST)
        torn[kind] += _check_after_kill(kind, reports, folder)
    return torn


def test_sigkill_in_purge_reconfigure_and_shutdown_loses_nothing_published(tmp_path):
    _trials(tmp_path, 6, seed=19)


@pytest.mark.slow
def test_sigkill_in_purge_reconfigure_and_shutdown_many_trials(tmp_path):
    torn = _trials(tmp_path, 54, seed=1919)
    print(f"54 kills; kills that left a temp file behind, per path: {torn}")
    # the seed decides where the kills land, the same on every machine: some land inside a write
    assert torn["reconfigure"] >= 1 and torn["shutdown"] >= 1, torn


def _park_until_killed(report, mode: str, folder: str, trial: int, min_reported: int, target: int,
                       rng_state: tuple) -> int:
    """In a child: park (disk) or park and spill (tiered) in a loop, reporting each conversation once its files
    are published, until the fault point armed after `min_reported` reports kills the process."""
    rng = random.Random()
    rng.setstate(rng_state)  # the parent's generator, as a forked child would go on with it
    slots = FakeSlots()
    reported: set[str] = set()
    arm_fault_points(target, lambda: len(reported) >= min_reported)
    c = make_cache(storage=mode, dir=folder, ram_bytes=8 * BLOCK * BPT, disk_bytes=1 << 30, slots=100_000)
    parked: dict[str, list[int]] = {}
    for i in range(10_000):
        base = conversation(1000 * trial + i, rng.randrange(1, 12) * BLOCK + rng.randrange(BLOCK))
        r = park_tokens(c, slots, base)
        assert r.parked, r
        parked[r.conversation_id] = base
        assert c.flush(30)  # every write is published before the next park starts
        for info in c.conversations():  # disk parks and tiered spills alike, once published
            if info.tier == "disk" and not info.pending and info.id in parked and info.id not in reported:
                report(json.dumps([info.id, parked[info.id]]) + "\n")
                reported.add(info.id)
    return 3  # reached only when the fault point was never hit


def test_sigkill_during_parks_and_spills_leaves_only_whole_files(tmp_path):
    """Children park (disk) or park and spill (tiered) in a loop, reporting each conversation once its files are
    published; each is killed at a seeded point inside a file write once it has reported a seeded number."""
    rng = random.Random(7)
    slots = FakeSlots()
    published: dict[str, list[int]] = {}
    slots_identity_key = identity().key
    checked: set[str] = set()
    torn = 0
    for trial in range(12):
        mode = "disk" if trial % 2 == 0 else "tiered"
        min_reported, target = rng.randint(1, 3), rng.randrange(60)
        # The first child starts as on Windows, in a fresh interpreter; forking the others keeps the test quick.
        status, lines = run_child(_park_until_killed, mode, str(tmp_path), trial, min_reported, target,
                                  rng.getstate(), method=SPAWN if trial == 0 else FAST)
        assert crashed(status), status
        reported_now = 0
        for line in lines:
            assert line.endswith("\n"), line  # each report is one write, made before the next park
            cid, toks = json.loads(line)
            published[cid] = toks
            reported_now += 1
        assert reported_now >= min_reported, (trial, reported_now, min_reported)
        # after every kill: a new engine adopts no partial file, and everything published is there and restores
        sub = os.path.join(str(tmp_path), slots_identity_key)
        torn += any(".tmp-" in n for n in os.listdir(sub))
        c = make_cache(storage="disk", dir=str(tmp_path), disk_bytes=1 << 30, slots=100_000)
        assert not any(".tmp-" in n for n in os.listdir(folder_of(c)))
        found = {r.id: r.tokens for r in c.conversations()}
        assert set(published) <= set(found), set(published) - set(found)
        for cid, toks in published.items():
            assert found[cid] == len(toks)
            if cid not in checked:
                check_restores(c, slots, toks)  # byte-identical to what the child parked
        for cid in set(found) - set(published) - checked:  # written but killed before it was reported
            check_restores(c, slots, c.disk.index.convs[cid].tokens.tolist())
        checked |= set(found)
        c.close(spill=False)
    assert torn >= 1  # some kills did land inside a write (the seed decides which, the same on every machine)
    print(f"12 kills, {len(published)} conversations reported published, {torn} kills left a temp file behind")
