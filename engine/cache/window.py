"""Parking only the window: what the cache keeps of a sliding-window model's local layers.

A local (sliding-window) layer's query at position p reads the keys (p - W, p] only, so a continuation from
position n needs that layer's rows [n - W + 1, n) and nothing older. For an identity with local layers:
- every block and tail holds the *global* layers' K/V only (part `kv`, [n_global, 2, tokens, heads, dim]):
  blocks stay content-addressed and shared by every conversation that contains them, as before;
- each conversation keeps, as its own checkpoint (a state part `window` with a token axis, stored like a
  hybrid model's checkpoints: in RAM with the entry, `ck.<position>.window` in its manifest), the local
  layers' rows [p - W + 1, N) for a position p: a checkpoint at p serves a resume at any n in [p, N], N the
  conversation's length, since the rows such a resume reads, [n - W + 1, n), lie inside.
The runtime (engine/runtime/windows.py) puts that checkpoint at its last prompt's last token (P - 1), or at
N - one block when the answer was longer: a follow-up (resume at N), and the same turn asked again or a
restart that finds the whole prompt parked (resume at P - 1, an answer of up to one block) are served by it.
A prefix match that leaves the conversation before the checkpoint (an edited earlier message, the same turn
asked again after a longer answer) finds no local rows to resume from: the lookup offers nothing there and the
request prefills (/cache/requests says why: reason `window`).

Local-layer bytes of a parked conversation: at most W - 1 + one block of rows, whatever its length; the
global layers keep every row. Why not blocks of local layers kept within W of the end (the first design):
those blocks are shared by key, so one conversation's window would be a block another conversation holds
without its local layers, and the blocks' presence would no longer be a prefix property of the chain; a
window owned by the conversation keeps blocks uniform, shared and deduplicated exactly as before, at the
price of not sharing the last window of two conversations that end the same way.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.cache.parts import ATTN_KV, PartSpec
from engine.kv import KVLayout

WINDOW = "window"  # the state part's name (tensor `ck.<position>.window` in a manifest)
ATTN_WINDOW = "attn_window"


def global_part(layout: KVLayout, local_layers: tuple[int, ...]) -> PartSpec:
    """The `kv` part of a windowed identity: the global layers' K/V only."""
    dims = (layout.n_layers - len(local_layers), *layout.host_shape(-1)[1:])
    return PartSpec("kv", ATTN_KV, layout.dtype, dims, dims.index(-1))


def window_part(layout: KVLayout, local_layers: tuple[int, ...]) -> PartSpec:
    """The `window` state part: the local layers' K/V of the rows a checkpoint keeps (any count)."""
    dims = (len(local_layers), *layout.host_shape(-1)[1:])
    return PartSpec(WINDOW, ATTN_WINDOW, layout.dtype, dims, dims.index(-1))


def first_row(position: int, window: int) -> int:
    """The first local row a checkpoint at `position` holds: a resume at `position` reads from there."""
    return max(0, position - window + 1)


def checkpoint_for(positions: Iterable[int], n: int) -> int | None:
    """The checkpoint that serves a resume at n: the deepest at or before n (it holds every local row from its
    own first row to the conversation's end), or None."""
    return max((p for p in positions if p <= n), default=None)


def cut(rows: torch.Tensor, position: int, n: int, window: int, token_axis: int) -> torch.Tensor:
    """The local rows [first_row(n), n) of a checkpoint at `position` (a view): what a resume at n reads."""
    first, lo = first_row(position, window), first_row(n, window)
    assert position <= n and first <= lo and n - first <= rows.shape[token_axis], (position, n, rows.shape)
    return rows.narrow(token_axis, lo - first, n - lo)
