"""Rotary position embeddings: inverse frequencies for each scaling scheme, and cos/sin tables.

Follows transformers' `rotate_half` convention (the two halves of a head are rotated together), so keys
written to the K/V buffers match what an HF model computes for the same position.
"""

from __future__ import annotations

import math

import torch

from engine.model.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim/2] float32, attention scaling applied to cos/sin) for this model's RoPE."""
    dim = config.head_dim
    base = config.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    # "dynamic" rescales only past the trained context, and the engine caps slots at that context.
    if kind in ("default", "dynamic"):
        return inv_freq, 1.0
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        low_freq_factor = float(scaling["low_freq_factor"])
        high_freq_factor = float(scaling["high_freq_factor"])
        old_context = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_context / low_freq_factor
        high_freq_wavelen = old_context / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn(config, scaling, factor)
    raise ValueError(f"rope scaling {kind!r} is not supported")


def _yarn(config: ModelConfig, scaling: dict, factor: float) -> tuple[torch.Tensor, float]:
    dim = config.head_dim
    base = config.rope_theta
    original = scaling.get("original_max_position_embeddings") or config.max_position_embeddings

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation_factor = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (1.0 / pos_freqs) * extrapolation_factor
    return inv_freq, float(attention_factor)


class RotaryTable:
    """cos/sin rows per absolute position, grown on demand, one copy per device and dtype."""

    def __init__(self, config: ModelConfig, freq_factors: torch.Tensor | None = None) -> None:
        inv_freq, self.attention_scaling = inverse_frequencies(config)
        if freq_factors is not None:  # GGUF files may carry llama3-style scaling as per-frequency divisors
            inv_freq = inv_freq / freq_factors.float()
        self.inv_freq = inv_freq
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, n_positions: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin as [>= n_positions, head_dim] on `device` in `dtype`."""
        key = (device, dtype)
        table = self._tables.get(key)
        if table is None or table[0].shape[0] < n_positions:
            size = max(n_positions, 2 * table[0].shape[0] if table is not None else 256)
            positions = torch.arange(size, dtype=torch.int64).float()
            freqs = torch.outer(positions, self.inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos = (emb.cos() * self.attention_scaling).to(device=device, dtype=dtype)
            sin = (emb.sin() * self.attention_scaling).to(device=device, dtype=dtype)
            table = (cos, sin)
            self._tables[key] = table
        return table
