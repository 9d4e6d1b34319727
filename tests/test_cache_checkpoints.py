"""Recurrent-state checkpoints (hybrid models) in the conversation cache: stored in the block they end (shared
with it) or with the conversation, counted in every budget, restored only at the exact position they were
taken at, refused whole when damaged, and kept across a restart."""

from __future__ import annotations

import os

import pytest
import torch

from engine.cache import CacheIdentity
from engine.cache.errors import CacheRestoreError
from engine.cache.fileformat import read_header
from tests.test_cache_support import BLOCK, LAYOUT, MODEL, FakeSlots, conversation, make_cache

STATE = {"parts": [[0, "conv", [3, 8]], [0, "ssm", [2, 4, 4]], [2, "conv", [3, 8]]], "dtype": "float32"}


def hybrid() -> CacheIdentity:
    return CacheIdentity(dict(MODEL), LAYOUT, BLOCK, state=STATE)


def state_at(tokens: list[int], n: int) -> dict[str, torch.Tensor]:
    """A stand-in recurrent state: a function of the first n tokens (equal prefixes, equal states)."""
    seed = float(sum((i + 1) * t for i, t in enumerate(tokens[:n])) % 9973)
    out = {}
    for k, (layer, name, shape) in enumerate(STATE["parts"]):
        out[f"state.{layer}.{name}"] = torch.full(shape, seed + k, dtype=torch.float32) + torch.arange(
            torch.Size(shape).numel(), dtype=torch.float32).view(shape)
    return out


class Slots(FakeSlots):
    def checkpoints(self, tokens: list[int], positions: list[int]) -> dict[int, dict]:
        return {p: state_at(tokens, p) for p in positions}

    def writer(self, slot: int, got: dict):
        def write(start: int, parts: dict) -> None:
            if "kv" in parts:
                self.kv.write(slot, start, parts["kv"])
            else:
                got[start] = parts
        return write


def test_the_identity_covers_the_state_parts():
    plain, hyb = CacheIdentity(dict(MODEL), LAYOUT, BLOCK), hybrid()
    assert "state_parts" not in plain.describe() and plain.state_bytes == 0
    assert [s.kind for s in hyb.state_parts] == ["recurrent_conv", "recurrent_ssm", "recurrent_conv"]
    assert hyb.key != plain.key and hyb.kv_key != plain.kv_key
    assert hyb.state_bytes == (24 + 32 + 24) * 4


def park(cache, slots: Slots, tokens: list[int], positions: list[int]):
    slots.fill(0, tokens)
    return cache.park(tokens, slots.reader(0), checkpoints=slots.checkpoints(tokens, positions))


@pytest.mark.parametrize("storage", ["ram", "disk"])
def test_checkpoints_are_stored_shared_counted_and_restored_at_their_position(tmp_path, storage):
    ident = hybrid()
    cache, slots = make_cache(ident, storage=storage, dir=str(tmp_path)), Slots()
    system = conversation(1, 4 * BLOCK)
    a, b = conversation(2, 6 * BLOCK + 3, system), conversation(3, 5 * BLOCK + 9, system)
    for tokens in (a, b):  # a checkpoint at the system prompt's end (a block end), one at a prompt end, the end
        assert park(cache, slots, tokens, [4 * BLOCK, 4 * BLOCK + 5, len(tokens)]).parked
    assert cache.flush(10)
    st, sb = cache.stats(), ident.state_bytes
    if storage == "ram":
        blocks = 4 + 2 + 1
        own = sum((len(t) % BLOCK) * ident.bytes_per_token + 4 * len(t) + 2 * sb for t in (a, b))
        assert st.blocks_ram == blocks and st.bytes_ram == blocks * ident.block_bytes + 1 * sb + own
    else:
        folder = st.dir
        names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
        with_state = 0
        for name in names:
            with open(os.path.join(folder, name), "rb") as f:
                tensors = set(read_header(f).tensors)
            with_state += name.startswith("blk-") and "state.0.ssm" in tensors
            if name.startswith("conv-"):
                assert sum(t.startswith("ck.") for t in tensors) == 2 * len(STATE["parts"])
        assert with_state == 1  # the shared prompt's checkpoint, stored once in its block
        assert st.bytes_disk == sum(os.path.getsize(os.path.join(folder, n)) for n in names)
    assert sum(c.bytes for c in cache.conversations()) >= 2 * 3 * sb

    def resume(request: list[int], cache=cache) -> tuple[int, dict]:
        hit = cache.lookup(request)
        assert hit is not None
        got: dict = {}
        cache.restore(hit, slots.writer(1, got))
        assert list(got) == [hit.n_tokens]  # the state comes last, at the restored position
        return hit.n_tokens, got[hit.n_tokens]

    for request, want in ((a + [7, 8], len(a)),  # a follow-up: from a's end
                          (a[: 4 * BLOCK + 9] + [1, 2, 3], 4 * BLOCK + 5),  # an edit: from the prompt end before it
                          (a[: 4 * BLOCK + 2] + [5, 5, 5], 4 * BLOCK)):  # from the shared block's checkpoint
        n, state = resume(request)
        assert n == want and all(torch.equal(state[k], v) for k, v in state_at(request, n).items())
        assert torch.equal(slots.kv.read(1, 0, n), slots.kv.read(0, 0, n) if request[:n] == b[:n] else
                           _kv_of(slots, a, n))
    assert cache.lookup(a[: 3 * BLOCK] + [9] * 20) is None  # no checkpoint before the edit: nothing to resume
    cache.close(spill=False)
    if storage == "disk":  # a restart keeps every checkpoint and where it is
        again = make_cache(ident, storage="disk", dir=str(tmp_path))
        n, state = resume(a[: 4 * BLOCK + 9] + [1, 2, 3], again)
        assert n == 4 * BLOCK + 5 and torch.equal(state["state.2.conv"], state_at(a, n)["state.2.conv"])
        again.close(spill=False)


def _kv_of(slots: Slots, tokens: list[int], n: int) -> torch.Tensor:
    slots.fill(0, tokens)
    return slots.kv.read(0, 0, n)


def test_a_damaged_checkpoint_refuses_the_whole_restore(tmp_path):
    ident = hybrid()
    cache, slots = make_cache(ident, storage="disk", dir=str(tmp_path)), Slots()
    a = conversation(5, 3 * BLOCK + 7)
    assert park(cache, slots, a, [len(a)]).parked and cache.flush(10)
    folder = cache.stats().dir
    (name,) = [n for n in os.listdir(folder) if n.startswith("conv-")]
    path = os.path.join(folder, name)
    with open(path, "rb") as f:
        header = read_header(f)
    entry = header.tensors[f"ck.{len(a)}.state.0.ssm"]
    with open(path, "r+b") as f:  # one flipped byte inside the checkpoint's tensor
        f.seek(header.data_start + entry.begin + 5)
        byte = f.read(1)
        f.seek(header.data_start + entry.begin + 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    hit = cache.lookup(a + [1])
    assert hit is not None and hit.n_tokens == len(a)
    calls: dict = {}
    written: list = []
    with pytest.raises(CacheRestoreError, match="damaged"):
        cache.restore(hit, lambda start, parts: written.append(start) or calls.update({start: parts}))
    assert written == [] and cache.stats().restore_failures == 1  # nothing reached the slot
    assert cache.lookup(a + [1]) is None and not os.path.exists(path)
    cache.close(spill=False)


def test_checkpoints_of_a_wrong_shape_are_refused():
    cache, slots = make_cache(hybrid()), Slots()
    tokens = conversation(6, 2 * BLOCK)
    slots.fill(0, tokens)
    bad = {len(tokens): {**state_at(tokens, len(tokens)), "state.0.ssm": torch.zeros(2, 4, 5)}}
    result = cache.park(tokens, slots.reader(0), checkpoints=bad)
    assert not result.parked and result.reason == "read_error"


def test_tiered_spill_keeps_the_checkpoints(tmp_path):
    ident = hybrid()
    cache, slots = make_cache(ident, storage="tiered", dir=str(tmp_path)), Slots()
    a = conversation(7, 2 * BLOCK + 3)
    assert park(cache, slots, a, [BLOCK, len(a)]).parked
    cache.close(spill=True)
    again = make_cache(ident, storage="tiered", dir=str(tmp_path))
    hit = again.lookup(a + [4])
    assert hit is not None and hit.tier == "disk" and hit.n_tokens == len(a)
    got: dict = {}
    again.restore(hit, slots.writer(1, got))
    assert torch.equal(got[len(a)]["state.0.conv"], state_at(a, len(a))["state.0.conv"])
    again.close(spill=False)
