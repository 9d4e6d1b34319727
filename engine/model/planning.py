"""Stage planning: which layers go on which device, and how many bytes a layer needs there."""

from __future__ import annotations

import psutil
import torch

from engine.model import moe_loading
from engine.model.config import ModelConfig


def plan_stages(
    n_layers: int, devices: str, layer_split: str, *, bytes_per_layer: int = 0
) -> list[tuple[torch.device, int, int]]:
    """[(device, first_layer, end_layer)] covering all layers; ValueError with the reason when impossible.

    `bytes_per_layer` (weights + K/V per layer, an estimate) enables the free-memory check.
    """
    if n_layers <= 0:
        raise ValueError(f"n_layers must be positive, got {n_layers}")
    device_list = _parse_devices(devices)
    split = layer_split.strip()
    if not split:
        counts = [n_layers]
        device_list = device_list[:1]
    elif split == "auto":
        if len(device_list) > n_layers:
            raise ValueError(f"--layer-split auto: {len(device_list)} devices but only {n_layers} layers")
        counts = _proportional([_free_bytes(d) for d in device_list], n_layers)
    else:
        try:
            counts = [int(p) for p in split.split(",")]
        except ValueError:
            raise ValueError(f'--layer-split: expected auto or layer counts like "12,18", got "{layer_split}"') from None
        if len(counts) != len(device_list):
            raise ValueError(
                f"--layer-split: {len(counts)} counts for {len(device_list)} devices ({devices}); give one per device"
            )
        if any(c <= 0 for c in counts):
            raise ValueError(f"--layer-split: every device needs at least one layer, got {layer_split}")
        if sum(counts) != n_layers:
            raise ValueError(f"--layer-split: counts sum to {sum(counts)}, but the model has {n_layers} layers")
    stages: list[tuple[torch.device, int, int]] = []
    first = 0
    for device, count in zip(device_list, counts, strict=True):
        stages.append((device, first, first + count))
        first += count
    if bytes_per_layer > 0:
        for device, a, b in stages:
            need, free = (b - a) * bytes_per_layer, _free_bytes(device)
            if need > free:
                raise ValueError(
                    f"{device}: {b - a} layers need about {need / 2**20:.0f} MiB, only {free / 2**20:.0f} MiB free; "
                    "give it fewer layers with --layer-split or use another device"
                )
    return stages


def layer_bytes(config: ModelConfig, dtype: torch.dtype, n_slots: int, ctx: int,
                cpu_experts: frozenset[int] = frozenset()) -> int:
    """Estimated bytes one layer needs on its device: weights plus K/V for `n_slots` slots of `ctx` tokens
    (the `bytes_per_layer` of plan_stages); the routed experts of the layers in `cpu_experts` are in host RAM,
    not on the layer's device."""
    if not isinstance(config, ModelConfig):  # engine.model.hybrid: recurrent layers + attention layers
        from engine.model.hybrid.sizes import layer_bytes as hybrid_layer_bytes

        return hybrid_layer_bytes(config, dtype, n_slots, ctx, cpu_experts)
    c = config
    heads, width = c.kv_row
    kv = 2 * n_slots * ctx * heads * width  # the slots' row, every layer alike
    return max(_one_layer_weights(c, i, cpu_experts) for i in range(c.n_layers)) * dtype.itemsize + kv * dtype.itemsize


def _one_layer_weights(c: ModelConfig, i: int, cpu_experts: frozenset[int]) -> int:
    """Layer `i`'s weights (experts and Gemma 4's per-layer shapes, MLP widths and blocks make layers differ)."""
    kv_heads, head_dim = c.layer_heads(i)
    q_rows, kv_rows = c.n_heads * head_dim, kv_heads * head_dim * (i < c.kv_layers)
    if c.is_moe_layer(i):
        mlp = moe_loading.mlp_weights(c, i) - (moe_loading.routed_expert_weights(c) if i in cpu_experts else 0)
    else:
        mlp = 3 * c.hidden_size * c.mlp_size(i)
    n_experts, _, expert_size = c.parallel_experts  # Gemma 4's block beside the MLP, with its router
    on_device = 0 if i in cpu_experts else 3 * c.hidden_size * expert_size  # its experts in host RAM when placed
    mlp += n_experts * (on_device + c.hidden_size) + 2 * c.per_layer_input * c.hidden_size
    weights = (q_rows + 2 * kv_rows) * c.hidden_size + c.hidden_size * q_rows + mlp
    weights += 2 * c.hidden_size + (q_rows + 2 * kv_rows if c.attention_bias else 0)
    if c.mla is not None:  # the latent projections instead (engine/model/mla.py)
        m, heads = c.mla, c.n_heads
        weights = (m.q_rows(heads) + m.latent_width) * c.hidden_size + c.hidden_size * heads * m.v_head_dim + mlp
        weights += heads * (m.qk_nope_head_dim + m.v_head_dim) * m.kv_lora_rank + 2 * c.hidden_size
        if m.q_lora_rank is not None:
            weights += heads * (m.qk_nope_head_dim + m.qk_rope_head_dim) * m.q_lora_rank
    return weights


def _parse_devices(devices: str) -> list[torch.device]:
    text = devices.strip() or "auto"
    if text == "auto":
        return [torch.device("cuda:0" if torch.cuda.is_available() else "cpu")]
    return [parse_device(part, "--devices") for part in text.split(",")]


def parse_device(text: str, flag: str) -> torch.device:
    """`cpu`, `cuda` or `cuda:N` as a device of this machine; ValueError naming `flag` when it is none of them or
    the GPU is not here."""
    name = text.strip()
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f'{flag}: unknown device "{name}"; expected cpu or cuda:N') from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{flag}: {name} requested but CUDA is not available on this machine")
        index = 0 if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise ValueError(f"{flag}: {name} requested but only {torch.cuda.device_count()} CUDA device(s) exist")
        return torch.device("cuda", index)
    if device.type != "cpu":
        raise ValueError(f'{flag}: unsupported device "{name}"; expected cpu or cuda:N')
    return device


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return int(psutil.virtual_memory().available)


def _proportional(weights: list[int], total: int) -> list[int]:
    """Split `total` layers in proportion to `weights`, at least one each, summing exactly to `total`."""
    n = len(weights)
    norm = sum(weights) or n
    shares = [max(w, 0) / norm * total if sum(weights) else total / n for w in weights]
    counts = [max(1, int(s)) for s in shares]
    while sum(counts) > total:
        i = max(range(n), key=lambda j: counts[j] - shares[j])
        counts[i] -= 1
    while sum(counts) < total:
        i = max(range(n), key=lambda j: shares[j] - counts[j])
        counts[i] += 1
    return counts
