"""Strata's serving engine: a Llama-family model on PyTorch, an OpenAI-compatible server and the conversation cache.

Importing this package is cheap (no torch): the desktop app reads `engine.config` for the settings table.
"""

__version__ = "0.1.0"
