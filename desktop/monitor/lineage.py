"""Which parked rows are one conversation under two ids: a conversation restored from disk and parked again.

In tiered mode a conversation restored from its disk copy and switched out again is parked in RAM as a new
entry with a new id (hits from zero); the disk copy stays under the old id until a later spill supersedes it.
`/cache/conversations` lists both, with nothing that ties them together (no `supersedes`), so the Monitor
showed the same conversation twice. The event log does tie them: a restore that read all of the disk entry's
tokens, then a park with the same name and system words holding at least those tokens, is the same conversation
going on. A restore of only part of an entry is a branch (another conversation sharing its start) and stays a
row of its own; so does anything the event log does not show (it is fetched while the Monitor is visible).
"""

from __future__ import annotations

from engine.contract import ConversationRow, Event


def learn_links(events: list[Event], rows: list[ConversationRow], links: dict[str, str]) -> bool:
    """Add to `links` (old id -> the id it continues as) what `events` show; forget ids no longer listed.

    Returns whether `links` changed. Links are remembered, not re-derived, as the event log is bounded.
    """
    by_id = {r.id: r for r in rows}
    changed = False
    for gone in [old for old, new in links.items() if old not in by_id or new not in by_id]:
        del links[gone]
        changed = True
    ordered = sorted(events, key=lambda e: e.time)
    for i, event in enumerate(ordered):
        old = by_id.get(event.conversation_id or "")
        if event.kind != "restore" or event.tier != "disk" or old is None or old.id in links:
            continue
        if event.tokens < old.tokens:
            continue  # part of it: whatever is parked next is a branch, not this conversation going on
        for later in ordered[i + 1:]:
            new = by_id.get(later.conversation_id or "")
            if later.kind != "park" or new is None or new is old:
                continue
            if (new.name, new.system) == (old.name, old.system) and new.tokens >= old.tokens:
                links[old.id] = new.id
                changed = True
                break
    return changed


def final_id(conv_id: str, links: dict[str, str]) -> str:
    """The id a conversation goes on under now (following links, which never loop: each points to a later park)."""
    seen = {conv_id}
    while conv_id in links and links[conv_id] not in seen:
        conv_id = links[conv_id]
        seen.add(conv_id)
    return conv_id
