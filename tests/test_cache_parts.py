"""State parts: a block holds every part of the identity, and files, budgets, dedup and restores treat them alike.

A second part kind (standing in for a recurrent-state checkpoint of a hybrid model) is declared on the identity
only; nothing else in the cache knows about it.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from engine.cache import CacheIdentity
from engine.cache.fileformat import read_header
from engine.cache.parts import PartSpec, layout_parts
from tests.test_cache_support import BLOCK, LAYOUT, MODEL, FakeSlots, conversation, make_cache

EXTRA = PartSpec("extra", "test_state", torch.float16, (3, -1, 5), 1)


class TwoPartIdentity(CacheIdentity):
    @functools.cached_property
    def parts(self) -> tuple[PartSpec, ...]:
        return (*layout_parts(self.layout), EXTRA)


def two_parts() -> CacheIdentity:
    return TwoPartIdentity(dict(MODEL), LAYOUT, BLOCK)


class TwoPartSlots(FakeSlots):
    """FakeSlots plus an `extra` part that is a function of the token ids, kept beside the K/V."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = [torch.zeros(3, 4096, 5, dtype=torch.float16) for _ in range(2)]

    def fill(self, slot: int, tokens: list[int]) -> None:
        super().fill(slot, tokens)
        t = torch.tensor(tokens, dtype=torch.float32).view(1, -1, 1)
        self.extra[slot].zero_()
        self.extra[slot][:, : len(tokens)] = (t * 0.001 + torch.arange(3).view(3, 1, 1)).to(torch.float16)

    def reader(self, slot: int):
        return lambda a, b: {"kv": self.kv.read(slot, a, b), "extra": self.extra[slot][:, a:b].clone()}

    def writer(self, slot: int, calls: list | None = None):
        def write(start: int, parts: dict) -> None:
            n = parts["kv"].shape[2]
            self.kv.write(slot, start, parts["kv"])
            self.extra[slot][:, start : start + n] = parts["extra"]

        return write


def restored_equal(cache, slots: TwoPartSlots, tokens: list[int]) -> bool:
    hit = cache.lookup(tokens + [7])
    assert hit is not None and hit.n_tokens == len(tokens)
    slots.kv.clear(1)
    slots.extra[1].zero_()
    cache.restore(hit, slots.writer(1))
    slots.fill(0, tokens)
    n = len(tokens)
    return torch.equal(slots.kv.read(1, 0, n), slots.kv.read(0, 0, n)) and torch.equal(
        slots.extra[1][:, :n], slots.extra[0][:, :n]
    )


def test_the_identity_names_its_parts_and_attention_only_keys_do_not_change():
    one = CacheIdentity(dict(MODEL), LAYOUT, BLOCK)
    assert [s.kind for s in one.parts] == ["attn_kv"] and "parts" not in one.describe()
    two = two_parts()
    assert two.key != one.key and two.kv_key != one.kv_key  # files of one are never taken for the other
    assert two.bytes_per_token == LAYOUT.bytes_per_token + EXTRA.nbytes(1)


@pytest.mark.parametrize("storage", ["ram", "disk"])
def test_every_part_is_parked_counted_shared_and_restored(tmp_path, storage):
    ident = two_parts()
    cache = make_cache(ident, storage=storage, dir=str(tmp_path))
    slots = TwoPartSlots()
    system = conversation(1, 4 * BLOCK)
    a, b = conversation(2, 6 * BLOCK + 3, system), conversation(3, 5 * BLOCK + 9, system)
    for tokens in (a, b):
        slots.fill(0, tokens)
        assert cache.park(tokens, slots.reader(0)).parked
    assert cache.flush(10)
    st = cache.stats()
    blocks = 4 + 2 + 1  # the shared system prompt's blocks are stored once, every part of them
    if storage == "ram":
        own = sum((len(t) % BLOCK) * ident.bytes_per_token + 4 * len(t) for t in (a, b))
        assert st.blocks_ram == blocks and st.bytes_ram == blocks * ident.block_bytes + own
    else:
        folder = st.dir
        names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
        assert sum(n.startswith("blk-") for n in names) == blocks
        for name in names:
            with open(os.path.join(folder, name), "rb") as f:
                tensors = set(read_header(f).tensors)
            assert tensors == ({"kv", "extra"} if name.startswith("blk-") else {"tokens", "kv", "extra"})
        assert st.bytes_disk == sum(os.path.getsize(os.path.join(folder, n)) for n in names)
    assert restored_equal(cache, slots, a) and restored_equal(cache, slots, b)
    cache.close(spill=False)
    if storage == "disk":  # the start-up index checks every part of every file, and restores them
        again = make_cache(ident, storage="disk", dir=str(tmp_path))
        assert len(again.conversations()) == 2 and restored_equal(again, slots, a)
        again.close(spill=False)


def test_a_park_missing_a_part_is_refused():
    cache, slots = make_cache(two_parts()), TwoPartSlots()
    tokens = conversation(4, 3 * BLOCK)
    slots.fill(0, tokens)
    only_kv = lambda a, b: {"kv": slots.kv.read(0, a, b)}  # noqa: E731
    result = cache.park(tokens, only_kv)
    assert not result.parked and result.reason == "read_error"
    assert cache.stats().entries_ram == 0
