"""Which slot a request takes under --parallel N: the cheapest victim (lowest priority, then fewest tokens to
recompute, then least recently used, pinned last), the slot a request continues or forks, and side calls."""

from __future__ import annotations

from engine.runtime.slot_choice import cheapest, choose_slot
from engine.runtime.state import Slot

SIDE = 512


def slot(i: int, n: int, priority: str = "normal", pinned: bool = False, last_used: float = 0.0) -> Slot:
    return Slot(i, tokens=list(range(1000 * i, 1000 * i + n)), priority=priority, pinned=pinned, last_used=last_used)


def test_the_cheapest_victim_is_lowest_priority_then_fewest_tokens_then_least_recently_used():
    assert cheapest([slot(0, 900, "normal"), slot(1, 4000, "low")]).id == 1
    assert cheapest([slot(0, 900, "high"), slot(1, 4000, "normal")]).id == 1
    assert cheapest([slot(0, 900), slot(1, 300)]).id == 1
    assert cheapest([slot(0, 300, last_used=2.0), slot(1, 300, last_used=1.0)]).id == 1
    assert cheapest([slot(0, 30, "low", pinned=True), slot(1, 4000, "high")]).id == 1, "pinned goes last"
    assert cheapest([slot(0, 4000, "low"), slot(1, 0, "high")]).id == 1, "an empty slot loses nothing"


def test_a_request_continuing_or_forking_a_slot_takes_it():
    parent, other = slot(0, 600, "high"), slot(1, 0)
    live = {0: 590, 1: 0}  # the parent's next turn: all but its last answer tokens are live
    assert choose_slot([parent, other], live, 620, SIDE).id == 0
    fork = {0: 400, 1: 0}  # shares 400 of the parent's 600: reuses more than it displaces
    assert choose_slot([parent, other], fork, 700, SIDE).id == 0


def test_a_shared_system_prompt_is_not_worth_displacing_a_long_conversation():
    parent, other = slot(0, 600, "high"), slot(1, 200, "low")
    live = {0: 25, 1: 25}
    assert choose_slot([parent, other], live, 900, SIDE).id == 1  # a long subagent: the cheaper slot
    assert choose_slot([parent, other], live, 60, SIDE).id == 1  # a side call
    assert choose_slot([parent], {0: 25}, 60, SIDE).id == 0  # one slot: it must go (and is parked)


def test_a_short_side_call_takes_the_cheapest_slot_even_where_a_slot_shares_more_than_it_loses():
    small, empty = slot(0, 50), slot(1, 0)
    live = {0: 30, 1: 0}  # shares 30 of its 100 tokens with a 50-token slot
    assert choose_slot([small, empty], live, 100, SIDE).id == 1
    assert choose_slot([small, empty], live, 100, 0).id == 0, "--side-call-tokens 0: side calls are not special"
