"""Strata Desktop: the Qt app that runs the engine, shows its conversation cache and edits its settings.

It never imports torch or engine internals; it reads `engine.config` (the settings table) and talks to the
engine over HTTP.
"""

__version__ = "0.1.0"
