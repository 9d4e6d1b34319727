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

from typing import Any

from desktop.monitor.report import number, timestamp


def learn_links(events: list[Any], rows: list[Any], links: dict[str, str]) -> bool:
    """Add to `links` (old id -> the id it continues as) what `events` show; forget ids no longer listed.

    Returns whether `links` changed. Links are remembered, not re-derived, as the event log is bounded.
    """
    by_id = {str(r["id"]): r for r in rows if isinstance(r, dict) and r.get("id") is not None}
    changed = False
    for old in [old for old, new in links.items() if old not in by_id or new not in by_id]:
        del links[old]
        changed = True
    ordered = sorted((e for e in events if isinstance(e, dict)), key=lambda e: timestamp(e.get("time")) or 0.0)
    for i, event in enumerate(ordered):
        old = by_id.get(str(event.get("conversation_id")))
        if event.get("kind") != "restore" or event.get("tier") != "disk" or old is None or old["id"] in links:
            continue
        restored, held = number(event, "tokens"), number(old, "tokens")
        if restored is None or held is None or restored < held:
            continue  # part of it: whatever is parked next is a branch, not this conversation going on
        for later in ordered[i + 1:]:
            new = by_id.get(str(later.get("conversation_id")))
            if later.get("kind") != "park" or new is None or new is old:
                continue
            if (new.get("name"), new.get("system")) == (old.get("name"), old.get("system")) and \
                    (number(new, "tokens") or 0) >= held:
                links[str(old["id"])] = str(new["id"])
                changed = True
                break
    return changed


def final_id(conv_id: Any, links: dict[str, str]) -> Any:
    """The id a conversation goes on under now (following links, which never loop: each points to a later park)."""
    seen = {conv_id}
    while str(conv_id) in links and links[str(conv_id)] not in seen:
        conv_id = links[str(conv_id)]
        seen.add(conv_id)
    return conv_id
