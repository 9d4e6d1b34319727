"""A sliding-window model's slots as the conversation cache sees them: global layers in blocks, the local
layers' last window as each conversation's own checkpoint (the design: engine/cache/window.py).

The slots' K/V buffers hold every layer at every position. Parking reads the global layers for the blocks and
the local layers' rows [R - W + 1, N) for one checkpoint at R, the last prompt's last token (moved up to N - one
block when the answer was longer, so a conversation keeps at most W - 1 + one block of local rows). A restore
writes the global layers of every restored row and the local layers of the rows the resume reads; the older
local rows of the slot are then not the conversation's (`floor`), so the slot's own contents are reused for a
prompt only from where its local rows are whole.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.cache.parts import Parts, ReadParts, WriteParts
from engine.cache.window import WINDOW, first_row
from engine.kv import KVBuffers


class SlotWindows:
    """Every slot's first local row that holds its own K/V (0 unless restored from a window), and the cache's
    reader, checkpoints and writer for a model whose layers `local` attend to a window of `window` tokens."""

    def __init__(self, kv: KVBuffers, window: int, local: tuple[int, ...], block_tokens: int) -> None:
        n_layers = kv.layout.n_layers
        assert window > 0 and local and set(local) <= set(range(n_layers)), (window, local, n_layers)
        self.kv = kv
        self.window = window
        self.block_tokens = block_tokens
        self.local = torch.tensor(local, dtype=torch.int64)
        self.globals = torch.tensor([i for i in range(n_layers) if i not in local], dtype=torch.int64)
        self.floors = [0] * kv.n_slots

    # ------------------------------------------------------------ reuse of a slot's own contents

    def reusable(self, slot: int, common: int) -> int:
        """Tokens of the slot's contents a prompt sharing `common` of them can keep: all of them when the rows
        a resume there reads are the slot's own, else none."""
        return common if first_row(common, self.window) >= self.floors[slot] else 0

    def clear(self, slot: int) -> None:
        self.floors[slot] = 0

    # ------------------------------------------------------------ what the cache parks and restores

    def reader(self, slot: int) -> ReadParts:
        """Blocks and tails: the global layers' K/V of tokens [start, end)."""
        return lambda start, end: {"kv": self.kv.read(slot, start, end).index_select(0, self.globals)}

    def checkpoints(self, slot: int, n_tokens: int, prompt_tokens: int) -> dict[int, Parts]:
        """The conversation's window checkpoint: at R = its last prompt's last token (or N - one block, or the
        first position whose rows are the slot's own, whichever is later), the local rows [R - W + 1, N)."""
        at = max(prompt_tokens - 1, n_tokens - self.block_tokens, self.floors[slot] + self.window - 1, 1)
        at = min(at, n_tokens)
        if first_row(at, self.window) < self.floors[slot]:
            return {}  # cannot happen for a slot that grew from a resume point; never park rows not its own
        rows = self.kv.read(slot, first_row(at, self.window), n_tokens).index_select(0, self.local)
        return {at: {WINDOW: rows}}

    def writer(self, slot: int, write_kv: Callable[[int, torch.Tensor], None]) -> WriteParts:
        """The cache's restore writer: global-layer pieces into every row (the local layers zeroed: they are
        never read), then the window (the last call, at the restored position n) into the local layers' rows
        [n - W + 1, n); the slot's floor moves there."""
        layout = self.kv.layout

        def write(start: int, parts: Parts) -> None:
            if WINDOW not in parts:
                data = parts["kv"]
                full = torch.zeros(layout.host_shape(data.shape[2]), dtype=layout.dtype)
                full.index_copy_(0, self.globals, data)
                write_kv(start, full)
                return
            rows = parts[WINDOW]
            first = first_row(start, self.window)
            assert rows.shape[2] == start - first, (rows.shape, start)
            if rows.shape[2]:
                current = self.kv.read(slot, first, start)  # the global layers just written
                current.index_copy_(0, self.local, rows)
                write_kv(first, current)
            self.floors[slot] = first

        return write


def slot_windows(config, kv: KVBuffers, block_tokens: int) -> SlotWindows | None:
    """The windows of a model whose config declares sliding layers (None for the others)."""
    if not getattr(config, "sliding_layers", ()) or config.sliding_window is None:
        return None
    # The sliding layers among those the slots hold (Gemma 4's K/V-sharing layers hold none).
    local = tuple(i for i in config.sliding_layers if i < kv.layout.n_layers)
    return SlotWindows(kv, config.sliding_window, local, block_tokens) if local else None
