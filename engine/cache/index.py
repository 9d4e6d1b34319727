"""The bookkeeping one tier keeps: blocks with their holders, conversations in LRU order, bytes used.

Blocks are content-addressed by their chained key and held by every parked conversation that contains them;
a block's bytes are freed only when its last holder leaves. Conversations are kept least recently used first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from engine.cache.attrs import DEFAULT_PRIORITY
from engine.cache.lifecycle import EntryState, check_transition
from engine.cache.parts import Parts

History = tuple[float, int, str, bool, str, str, str]  # (last_used, hits, priority, pinned, name, client, system)


@dataclass(eq=False)
class Block:
    key: str
    nbytes: int  # counted against the tier's budget (tensor bytes in RAM, file bytes on disk)
    data: Parts | None = None  # its state parts in RAM; on disk, the copy still waiting for its write
    on_disk: bool = False
    holders: set[str] = field(default_factory=set)
    pins: int = 0  # I/O in flight: never evicted or purged while > 0
    failed: bool = False
    state: bool = False  # a hybrid model's recurrent state after the block's last token is stored with it


@dataclass(eq=False)
class Conv:
    id: str
    tokens: np.ndarray  # int32
    keys: list[str]  # keys of the full blocks
    nbytes: int  # own bytes: tail and token ids in RAM, the manifest file on disk
    tail: Parts | None = None  # state parts of the last partial block (RAM, or pending on disk)
    # a hybrid model's checkpoints not at a block end (a prompt's end, its own end), by position: the state
    # parts in RAM (or pending on disk), None once only the manifest on disk holds them
    checkpoints: dict[int, Parts | None] = field(default_factory=dict)
    created: float = 0.0
    last_used: float = 0.0
    hits: int = 0
    # what the requests said about it (engine.cache.attrs); `pinned` is the user's pin, which budgets respect
    # (engine.cache.policy), not an I/O hold (`pins`, `TierIndex.is_pinned`)
    priority: str = DEFAULT_PRIORITY
    pinned: bool = False
    name: str = ""
    client: str = ""
    system: str = ""
    state: EntryState = EntryState.RAM
    pins: int = 0  # restores reading the entry right now (engine thread); the writer's hold is WRITING
    error: str = ""  # why its write failed (state FAILED)
    supersedes: list[str] = field(
        default_factory=list
    )  # disk: prefix entries to drop once this one is written
    # disk, pending: the written version this entry replaces under the same id (its manifest is still the file
    # on disk until this one is written); a failed or dropped write puts it back, so nothing on disk is lost
    previous: Conv | None = None

    @property
    def attrs(self) -> tuple[str, bool, str, str, str]:
        return self.priority, self.pinned, self.name, self.client, self.system

    def set_attrs(self, attrs: tuple[str, bool, str, str, str]) -> None:
        self.priority, self.pinned, self.name, self.client, self.system = attrs

    @property
    def history(self) -> History:
        """What its manifest records besides tokens and state: last use, hits and attributes."""
        return (self.last_used, self.hits, *self.attrs)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def on_disk(self) -> bool:
        """Its manifest (and every block it names) is published."""
        return self.state is EntryState.WRITTEN

    @property
    def failed(self) -> bool:
        return self.state is EntryState.FAILED

    @property
    def busy(self) -> bool:
        """I/O in flight on the entry itself: the writer holds it, or a restore reads it."""
        return self.pins > 0 or self.state is EntryState.WRITING

    def move(self, new: EntryState) -> None:
        """Change state along a legal transition (asserted)."""
        check_transition(self.state, new)
        self.state = new


class TierIndex:
    """Blocks and conversations of one tier (no I/O, no policy: eviction order is engine.cache.policy)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.blocks: dict[str, Block] = {}
        self.convs: OrderedDict[str, Conv] = OrderedDict()
        self.bytes = 0

    def conv_bytes(self, conv: Conv) -> int:
        """Everything a restore of `conv` reads: its blocks (shared or not) and its own bytes."""
        return conv.nbytes + sum(self.blocks[k].nbytes for k in conv.keys)

    def add(self, conv: Conv, new_blocks: list[Block]) -> None:
        assert conv.id not in self.convs, conv.id
        for blk in new_blocks:
            assert blk.key not in self.blocks, blk.key
            self.blocks[blk.key] = blk
            self.bytes += blk.nbytes
        for k in conv.keys:
            self.blocks[k].holders.add(conv.id)
        self.convs[conv.id] = conv
        self.bytes += conv.nbytes

    def remove(self, conv_id: str) -> tuple[Conv, list[Block]]:
        """Drop a conversation; returns it and the blocks no one holds any more (already out of the index)."""
        conv = self.convs.pop(conv_id)
        self.bytes -= conv.nbytes
        freed = []
        for k in conv.keys:
            blk = self.blocks[k]
            blk.holders.discard(conv_id)
            if not blk.holders:
                del self.blocks[k]
                self.bytes -= blk.nbytes
                freed.append(blk)
        return conv, freed

    def reserve(self, keys: list[str], token: str) -> None:
        """Hold existing blocks for an entry being built, so evictions in the meantime cannot free them."""
        for k in keys:
            self.blocks[k].holders.add(token)

    def release(self, keys: list[str], token: str) -> list[Block]:
        """Undo `reserve`; returns blocks that nobody holds any more (already out of the index)."""
        freed = []
        for k in keys:
            blk = self.blocks.get(k)
            if blk is None:
                continue
            blk.holders.discard(token)
            if not blk.holders:
                del self.blocks[k]
                self.bytes -= blk.nbytes
                freed.append(blk)
        return freed

    def checkpoint_at_most(self, conv: Conv, n: int, block_tokens: int) -> int:
        """The deepest position <= n where `conv`'s recurrent state is stored (its own, or a block's end), or 0."""
        best = max((p for p in conv.checkpoints if p <= n), default=0)
        for i in range(min(len(conv.keys), n // block_tokens) - 1, -1, -1):
            if (i + 1) * block_tokens <= best:
                break
            if self.blocks[conv.keys[i]].state:
                return (i + 1) * block_tokens
        return best

    def touch(self, conv_id: str) -> None:
        self.convs.move_to_end(conv_id)

    def matched_blocks(self, keys: list[str]) -> int:
        """How many leading request keys this tier holds (keys chain, so presence is monotone)."""
        n = 0
        for k in keys:
            if k not in self.blocks:
                break
            n += 1
        return n

    def candidates(self, keys: list[str]) -> list[Conv]:
        """Conversations that can offer the longest prefix: holders of the deepest matched block, else all."""
        m = self.matched_blocks(keys)
        if m == 0:
            return list(self.convs.values())
        return [self.convs[c] for c in self.blocks[keys[m - 1]].holders]

    def prefixes_of(self, tokens: np.ndarray) -> list[Conv]:
        """Parked conversations whose tokens are a prefix of (or equal to) `tokens`: a park supersedes them."""
        n = len(tokens)
        return [
            c
            for c in self.convs.values()
            if c.n_tokens <= n
            and (c.n_tokens == 0 or c.tokens[0] == tokens[0])
            and np.array_equal(c.tokens, tokens[: c.n_tokens])
        ]

    def is_pinned(self, conv: Conv) -> bool:
        """I/O in flight on the entry, its blocks, or the version it replaces (whose manifest is being written)."""
        prev = conv.previous
        return conv.busy or (prev is not None and prev.busy) or any(self.blocks[k].pins > 0 for k in conv.keys)
