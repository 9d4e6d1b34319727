"""Which free slot a request takes, and so which live conversation it displaces (parked, to be restored).

A slot's loss is what taking it throws out of the live K/V: the tokens it holds beyond what the request reuses.
Losing fewer than MIN_PARK_TOKENS costs nothing worth counting (an empty slot, or the request continues what it
holds). Otherwise the cheapest victim is the one the cache would give up first (engine.cache.policy:
unpinned before pinned, low before normal before high), then the one with the fewest tokens to recompute, then
the least recently used.

A request takes the slot it reuses most of when that reuse is at least MIN_PARK_TOKENS and at least what the
slot loses (it continues the slot's conversation, or forks it): reusing a shared system prompt is not worth
displacing a long conversation while a cheaper slot is free. A side call, a short prompt (below
--side-call-tokens: a title, a summary) sharing less than half of itself with every slot, is cheap to prefill
anyway: it always takes the cheapest victim. Every other request takes the cheapest victim too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from engine.cache.policy import precedence_of
from engine.runtime.state import Slot

# A conversation shorter than this is cheaper to prefill again than to park; a hit that saves fewer tokens than
# this over the live slot is not worth parking the slot's conversation for.
MIN_PARK_TOKENS = 16


def loss_cost(slot: Slot, reuse: int) -> tuple:
    """Sort key of what taking `slot` for a request reusing `reuse` of its tokens costs (smaller = cheaper)."""
    lost = len(slot.tokens) - reuse
    assert lost >= 0, (slot.id, lost)
    if lost < MIN_PARK_TOKENS:
        return (0, (0, 0), -reuse, slot.last_used)
    return (1, precedence_of(slot.priority, slot.pinned), lost, slot.last_used)


def cheapest(free: Sequence[Slot], live: Mapping[int, int] | None = None) -> Slot:
    """The free slot whose loss is cheapest (`live`: tokens the request reuses of each; default none)."""
    return min(free, key=lambda s: loss_cost(s, live[s.id] if live else 0))


def choose_slot(free: Sequence[Slot], live: Mapping[int, int], n_prompt: int, side_call_tokens: int) -> Slot:
    """The slot a request of `n_prompt` tokens takes when no cache hit is restored (`live`: its reuse per slot)."""
    assert free, "a request is admitted only when a slot is free"
    best = max(free, key=lambda s: (live[s.id], -s.last_used))
    reuse = live[best.id]
    side_call = n_prompt < side_call_tokens and 2 * reuse < n_prompt
    if not side_call and reuse >= MIN_PARK_TOKENS and reuse >= len(best.tokens) - reuse:
        return best
    return cheapest(free, live)
