"""Shared pieces of the conversation-cache tests: a small K/V layout, a fake slot made of real KVBuffers."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from engine.cache import CacheIdentity, CacheSettings, ConversationCache
from engine.cache.parts import kv_reader, kv_writer
from engine.kv import KVBuffers, KVLayout

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUT = KVLayout(n_layers=4, n_kv_heads=2, head_dim=16, dtype=torch.float32)  # 1 KiB per token
BLOCK = 16
MODEL = {"architecture": "llama", "n_layers": 4, "tokenizer": "tok-1", "weights": "w-1"}


def identity(model: dict | None = None, layout: KVLayout = LAYOUT, block: int = BLOCK) -> CacheIdentity:
    return CacheIdentity(dict(model or MODEL), layout, block)


def settings(**kw) -> CacheSettings:
    base = dict(
        storage="ram",
        ram_bytes=64 << 20,
        disk_bytes=256 << 20,
        dir="",
        slots=64,
        min_free_bytes=0,
        days=30.0,
        block_tokens=BLOCK,
    )
    base.update(kw)
    return CacheSettings(**base)


def make_cache(ident: CacheIdentity | None = None, **kw) -> ConversationCache:
    ident = ident or identity()
    return ConversationCache(settings(block_tokens=ident.block_tokens, **kw), ident, engine_version="test")


class FakeSlots:
    """Real KVBuffers whose K/V is a deterministic function of (token, position): equal prefixes, equal K/V."""

    def __init__(self, layout: KVLayout = LAYOUT, n_slots: int = 2, ctx: int = 4096) -> None:
        self.layout = layout
        self.kv = KVBuffers(
            layout,
            n_slots,
            ctx,
            [("cpu", 0, layout.n_layers // 2), ("cpu", layout.n_layers // 2, layout.n_layers)],
        )
        self.tokens: list[list[int]] = [[] for _ in range(n_slots)]

    def fill(self, slot: int, tokens: list[int]) -> None:
        """Put the K/V a model would compute for `tokens` into `slot` (rows past them are zero)."""
        self.kv.clear(slot)
        n = len(tokens)
        t = torch.tensor(tokens, dtype=torch.float64).view(1, 1, n, 1, 1)
        pos = torch.arange(n, dtype=torch.float64).view(1, 1, n, 1, 1)
        lay = self.layout
        chan = torch.arange(lay.n_layers * 2 * lay.n_kv_heads * lay.head_dim, dtype=torch.float64).view(
            lay.n_layers, 2, 1, lay.n_kv_heads, lay.head_dim
        )
        data = torch.sin(t * 0.7919 + pos * 0.1234 + chan * 0.0137 + t * chan * 1e-4).to(lay.dtype)
        self.kv.write(slot, 0, data)
        self.tokens[slot] = list(tokens)

    def reader(self, slot: int):
        return kv_reader(lambda start, end: self.kv.read(slot, start, end))

    def writer(self, slot: int, calls: list | None = None):
        def write(start: int, data: torch.Tensor) -> None:
            if calls is not None:
                calls.append((start, data.shape[2]))
            self.kv.write(slot, start, data)

        return kv_writer(write)

    def snapshot(self, slot: int, n: int) -> torch.Tensor:
        return self.kv.read(slot, 0, n).clone()


def park_tokens(cache: ConversationCache, slots: FakeSlots, tokens: list[int], slot: int = 0, **kw):
    slots.fill(slot, tokens)
    return cache.park(tokens, slots.reader(slot), **kw)


def run_python(
    code: str, *, timeout: float = 60, env: dict | None = None, **kw
) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter with the repository importable."""
    full_env = {**os.environ, "PYTHONPATH": REPO, **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=REPO,
        **kw,
    )


def conversation(seed: int, n: int, prefix: list[int] | None = None) -> list[int]:
    """`prefix` followed by pseudo-random token ids up to `n` tokens."""
    g = torch.Generator().manual_seed(seed)
    base = list(prefix or [])
    return base + torch.randint(0, 32000, (n - len(base),), generator=g).tolist()
