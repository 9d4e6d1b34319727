"""The conversation cache's control calls (engine thread): its figures and parked conversations, priority, pin,
drop, purge, and the live settings that rebuild or reconfigure it. The cache itself may be off (None) and may
start or change while the engine runs, so everything else reads it through `CacheControl.cache`."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from engine import __version__
from engine.config import EngineConfig, setting_of
from engine.errors import BadValue, NotFound, Refused
from engine.figures import CacheFigures

if TYPE_CHECKING:
    from engine.cache.api import CacheAPI
    from engine.cache.identity import CacheIdentity
    from engine.cache.settings import CacheSettings

log = logging.getLogger("strata.engine")


def make_cache(config: EngineConfig, identity: CacheIdentity, share: float = 1.0,
               draft: bool = False) -> CacheAPI | None:
    """The conversation cache `config` asks for, or None when it is off; `share`, `draft`: see `cache_settings`."""
    if config.conversation_cache_storage == "ram" and config.conversation_cache_mib == 0:
        if not draft:
            log.info("conversation cache off (--conversation-cache-mib 0)")
        return None
    from engine.cache import ConversationCache

    return ConversationCache(cache_settings(config, share, draft), identity, engine_version=__version__)


def cache_settings(config: EngineConfig, share: float = 1.0, draft: bool = False) -> CacheSettings:
    """The cache settings of `config` with `share` of each byte budget: with --spec draft the model's cache and the
    draft model's (its K/V parked beside the conversation, engine/runtime/draft_states.py) split every budget by
    their bytes per token, so the two together stay within what was set. The draft's cache restores whatever it
    holds (no thresholds: it only ever follows a restore of the model's) and stays on this machine."""
    from engine.cache import CacheSettings

    settings = CacheSettings.from_engine_config(config)
    if share != 1.0:
        assert 0.0 < share < 1.0, share
        settings = settings.replace(**{name: int(getattr(settings, name) * share)
                                       for name in ("ram_bytes", "disk_bytes", "spill_queue_bytes")})
    if draft:
        settings = settings.replace(n_min=0, similarity=0.0, remote_url="")
    return settings


class CacheControl:
    """Owns the engine's settings and its conversation cache (engine thread only)."""

    def __init__(self, config: EngineConfig, identity: CacheIdentity, settle: Callable[[], None],
                 draft_identity: CacheIdentity | None = None) -> None:
        """`settle` waits for the restores being read, which finish on the cache they began on (their pins hold
        its files) before a settings change touches it. `draft_identity`: --spec draft's model (or --spec mtp's
        next-token layer), whose rows are parked in a cache of its own identity (`draft_cache`), so a foreign or
        damaged draft part fails alone."""
        self.config = config
        self.identity = identity
        self.settle = settle
        self.draft_identity = draft_identity
        # a parked conversation's id -> its draft part's id in `draft_cache`, as this engine parked them (a drop
        # takes both; after a restart an orphaned draft part goes by the draft cache's own eviction)
        self.draft_parts: dict[str, str] = {}
        self.draft_share = 0.0
        if draft_identity is not None:
            ours, theirs = identity.bytes_per_token, draft_identity.bytes_per_token
            self.draft_share = theirs / (ours + theirs)
        self.cache: CacheAPI | None = make_cache(config, identity, 1.0 - self.draft_share)
        self.draft_cache: CacheAPI | None = self._make_draft_cache(config)

    def _make_draft_cache(self, config: EngineConfig) -> CacheAPI | None:
        if self.draft_identity is None:
            return None
        return make_cache(config, self.draft_identity, self.draft_share, draft=True)

    def _follow_draft(self, config: EngineConfig) -> None:
        """The draft's cache takes the settings the model's took; where it cannot, it keeps its own (logged): its
        parts are an optimisation, never a reason to refuse a change the model's cache made."""
        from engine.cache.errors import CacheError

        try:
            if self.draft_cache is None:
                self.draft_cache = self._make_draft_cache(config)
            else:
                self.draft_cache.reconfigure(cache_settings(config, self.draft_share, draft=True))
        except (CacheError, ValueError, OSError) as exc:
            log.warning("the draft model's cache keeps its previous settings: %s", exc)

    def figures(self) -> CacheFigures:
        if self.cache is None:
            return CacheFigures(enabled=False, storage=self.config.conversation_cache_storage)
        return self.cache.stats()

    def conversations(self) -> list[dict]:
        return [] if self.cache is None else [c.to_dict() for c in self.cache.conversations()]

    def events(self, limit: int = 200) -> list[dict]:
        return [] if self.cache is None else self.cache.events(limit)

    def _parked(self, conv_id: str) -> CacheAPI:
        if self.cache is None:
            raise NotFound(f"conversation {conv_id!r} is not parked: the conversation cache is off", param="id")
        return self.cache

    def set_conversation(self, conv_id: str, *, priority: str | None, pinned: bool | None) -> list[dict]:
        """Change a parked conversation's priority and/or pin; its rows (one per tier) as they are now."""
        cache = self._parked(conv_id)
        try:
            target = cache.set_attrs(conv_id, priority=priority, pinned=pinned)
        except KeyError:
            raise NotFound(f"conversation {conv_id!r} is not parked; GET /cache/conversations lists those that are",
                           param="id") from None
        except ValueError as exc:
            raise BadValue(str(exc), param="priority") from None
        log.info("conversation %s: priority %s, pinned %s", target, priority or "unchanged",
                 "unchanged" if pinned is None else pinned)
        return [c.to_dict() for c in cache.conversations() if c.id == target]

    def drop_conversation(self, conv_id: str) -> dict:
        """Drop one parked conversation from every tier; what was dropped and what was skipped (a PurgeBody)."""
        cache = self._parked(conv_id)
        try:
            result = cache.drop(conv_id).to_dict()
        except KeyError:
            raise NotFound(f"conversation {conv_id!r} is not parked; GET /cache/conversations lists those that are",
                           param="id") from None
        log.info("conversation %s dropped: %s", conv_id, result)
        draft_id = self.draft_parts.pop(conv_id, None)
        if draft_id is not None and self.draft_cache is not None:
            with contextlib.suppress(KeyError):  # evicted or superseded meanwhile
                self.draft_cache.drop(draft_id)
        return result

    def purge(self, tier: str) -> dict:
        if tier not in ("ram", "disk", "all"):
            raise BadValue(f'tier: expected one of ram, disk, all, got "{tier}"', param="tier")
        if self.cache is None:
            return {"tier": tier, "dropped": {"conversations": 0, "bytes": 0}, "skipped": []}
        result = self.cache.purge(tier).to_dict()
        if self.draft_cache is not None:  # the draft's parts of what was purged
            self.draft_cache.purge(tier)
            if tier == "all":
                self.draft_parts.clear()
        log.info("cache purge %s: %s", tier, result)
        return result

    def settings(self) -> dict:
        """GET /cache/config: the live settings' values."""
        from engine.config import LIVE_SETTINGS

        return {
            "settings": {name: getattr(self.config, name) for name in LIVE_SETTINGS},
            "live": list(LIVE_SETTINGS),
            "effective_dir": self.config.cache_dir,
            "enabled": self.cache is not None and self.cache.settings.enabled,  # as /metrics says it
        }

    def update(self, changes: dict) -> dict:
        """PUT /cache/config: change live settings; the cache starts, or switches to them, or nothing changes."""
        from engine.config import LIVE_SETTINGS
        from engine.setting import SettingError

        if not isinstance(changes, dict) or not changes:
            raise BadValue("expected a JSON object of settings to change, e.g. {\"conversation_cache_mib\": 2048}")
        parsed: dict[str, Any] = {}
        for name, value in changes.items():
            if name not in LIVE_SETTINGS:
                try:
                    setting_of(name)
                except KeyError:
                    raise BadValue(f"unknown setting {name!r}; live settings: {', '.join(LIVE_SETTINGS)}",
                                   param=name) from None
                raise BadValue(f"{name} cannot change on a running engine; restart with the new value",
                               param=name)
            try:
                parsed[name] = setting_of(name).parse(value)
            except SettingError as exc:
                raise BadValue(str(exc), param=name) from exc
        try:
            new_config = self.config.replace(**parsed)  # the checks across settings (a remote store's needs)
        except SettingError as exc:
            raise BadValue(str(exc)) from None
        changed = [n for n in parsed if getattr(self.config, n) != getattr(new_config, n)]
        self.settle()
        if changed:
            from engine.cache.errors import CacheError

            try:
                if self.cache is None:
                    self.cache = make_cache(new_config, self.identity, 1.0 - self.draft_share)
                else:
                    self.cache.reconfigure(cache_settings(new_config, 1.0 - self.draft_share))
            except (CacheError, ValueError, OSError) as exc:
                start = "start with" if self.cache is None else "switch to"
                raise Refused(f"the cache could not {start} the new settings, nothing changed: {exc}") from exc
            self.config = new_config
            self._follow_draft(new_config)
        log.info("cache config changed: %s", ", ".join(f"{n}={getattr(new_config, n)}" for n in changed) or "nothing")
        return {**self.settings(), "changed": changed}
