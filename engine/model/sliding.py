"""Sliding-window attention: which layers attend to a window of recent tokens, as each family declares it, and
the key range and mask of a chunk under a window.

A window of W means what transformers' `sliding_window_overlay` means: the query at position p sees the keys
at positions (p - W, p], its own included, W keys at most. llama.cpp's `is_masked_swa` (standard type) is the
same rule. Keys outside the window are never read: a sliding layer's attention runs over the slot's rows
[max(0, start - W + 1), end) of the ordinary K/V buffers, so it costs no more than the window.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

# The families whose config.json may declare a window, and how transformers applies it:
#   all:   `sliding_window` (when not null) on every layer (Mistral predates `layer_types`).
#   gated: only with `use_sliding_window`; then the layers `layer_types` names "sliding_attention", or else the
#          layers from `max_window_layers` on (Qwen2, Qwen3).
#   typed: the layers `layer_types` names, or else every layer but each `sliding_window_pattern`-th (Gemma 3:
#          every 6th; gpt-oss: every 2nd, a sliding layer then a full one).
_HF_RULES = {"mistral": "all", "qwen2": "gated", "qwen3": "gated", "gemma3": "typed", "gemma4": "typed", "gpt_oss": "typed"}
_HF_DEFAULT_WINDOW = {"mistral": 4096, "qwen2": 4096, "qwen3": 4096, "gemma3": 4096, "gemma4": 512, "gpt_oss": 128}
GEMMA3_PATTERN = 6  # Gemma 3: five local layers, then a global one
# The period of full layers when neither config.json's `layer_types` nor a GGUF's pattern says (transformers'
# config classes; llama.cpp's set_swa_pattern for gemma3 and gpt-oss).
_DEFAULT_PATTERN = {"gemma3": GEMMA3_PATTERN, "gemma4": GEMMA3_PATTERN, "gpt_oss": 2, "gpt-oss": 2}


def hf_sliding_layers(arch: str, cfg: dict[str, Any], n_layers: int) -> tuple[int | None, tuple[int, ...]]:
    """(window, sliding layer indices) as transformers reads them from `cfg`; (None, ()) for full attention.

    ValueError for a window this engine does not run (a family without window support that declares one)."""
    rule = _HF_RULES.get(arch)
    if rule is None:
        if cfg.get("sliding_window") and cfg.get("use_sliding_window", True):
            raise ValueError(f"{arch}: sliding-window attention is not supported for this family")
        return None, ()
    window = cfg.get("sliding_window", _HF_DEFAULT_WINDOW[arch])
    if rule == "gated" and not cfg.get("use_sliding_window", False):
        window = None
    if rule == "typed" and window is None:  # Gemma's local layers keep their RoPE base, with a window of everything
        window = int(cfg.get("max_position_embeddings", 131072))
    if window is None:
        return None, ()
    types = cfg.get("layer_types")
    if rule == "all":
        layers = tuple(range(n_layers))
    elif types is not None:
        if len(types) != n_layers:
            raise ValueError(f"layer_types lists {len(types)} layers, the model has {n_layers}")
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise ValueError(f"layer_types: unknown layer type(s) {sorted(unknown)}")
        layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    elif rule == "gated":
        layers = tuple(range(int(cfg.get("max_window_layers", 28)), n_layers))
    else:
        pattern = int(cfg.get("sliding_window_pattern", _DEFAULT_PATTERN[arch]))
        layers = tuple(i for i in range(n_layers) if (i + 1) % pattern)
    return (int(window), layers) if layers else (None, ())


def gguf_sliding_layers(arch: str, meta: dict[str, Any], n_layers: int) -> tuple[int | None, tuple[int, ...]]:
    """(window, sliding layer indices) from GGUF metadata, as llama.cpp reads them.

    `<arch>.attention.sliding_window` gives the window; `<arch>.attention.sliding_window_pattern` (a period, or
    one flag per layer, true = sliding) the layers. Without a pattern key llama.cpp uses Gemma 3's period of 6
    for gemma3, a period of 2 for gpt-oss, and leaves the window unused for the other families it converts (Mistral,
    Qwen2)."""
    window = meta.get(f"{arch}.attention.sliding_window")
    if not window:
        return None, ()
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        if len(pattern) != n_layers:
            raise ValueError(f"{arch}.attention.sliding_window_pattern has {len(pattern)} flags for {n_layers} layers")
        layers = tuple(i for i, flag in enumerate(pattern) if flag)
    elif pattern:
        layers = tuple(i for i in range(n_layers) if (i + 1) % int(pattern))
    elif arch in _DEFAULT_PATTERN:
        layers = tuple(i for i in range(n_layers) if (i + 1) % _DEFAULT_PATTERN[arch])
    else:
        return None, ()
    return (int(window), layers) if layers else (None, ())


def check_windows(window: int | None, layers: Sequence[int], n_layers: int) -> str | None:
    """What is wrong with a (window, sliding layers) pair, or None."""
    if window is None:
        return "sliding layers are given without a window" if layers else None
    if not isinstance(window, int) or window <= 0:
        return f"sliding_window: expected a positive whole number, got {window!r}"
    if not layers:
        return "a sliding window is given without sliding layers"
    if list(layers) != sorted(set(layers)) or layers[0] < 0 or layers[-1] >= n_layers:
        return f"sliding layers {list(layers)} are not distinct, ordered layer indices below {n_layers}"
    return None


def first_key(start: int, window: int | None) -> int:
    """The first key row a chunk starting at `start` can see under `window` (0 for full attention)."""
    return 0 if window is None else max(0, start - window + 1)


def window_mask(start: int, n: int, window: int) -> torch.Tensor | None:
    """The boolean mask [n, end - first_key] of a chunk of `n` queries from `start` over its window's keys, or
    None when plain causal attention from key 0 is the same (the chunk starts at 0 and fits in the window)."""
    if start == 0 and n <= window:
        return None
    first = first_key(start, window)
    rows = torch.arange(start, start + n).unsqueeze(1)
    cols = torch.arange(first, start + n).unsqueeze(0)
    return (cols <= rows) & (cols > rows - window)
