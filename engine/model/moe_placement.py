"""Where a mixture-of-experts model's routed experts live: `--moe-experts gpu|cpu` and `--moe-cpu-layers N`.

As llama.cpp's `--cpu-moe` / `--n-cpu-moe N` do, the routed experts of some layers (all of them, or the first N)
can stay in host RAM while attention, the router, the shared expert and everything else run on the layer's
device: a Qwen3-30B-A3B-class model then needs a GPU for ~3B active parameters and RAM for the experts (the
"resident expert arena"). Experts kept on the CPU are packed as 4-bit groups (engine/model/int4.py) and run on
the CPU for the tokens routed to them (engine/model/moe.py moves the rows there and the results back).

Decisions:
- A flag naming layers the model does not have (`--moe-cpu-layers` above its layer count) is refused, and so is
  `--moe-cpu-layers` together with `--moe-experts cpu` (which already means every layer).
- On a model without experts the flags are ignored with a warning, not refused: the desktop app keeps one
  settings file across models, and a dense model has nothing to place.
- N counts layers from the first, dense ones included (llama.cpp's meaning), so `--moe-cpu-layers` equal to the
  layer count is every expert layer.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

from engine.model import int4
from engine.model.kquant_weight import KQuantWeight
from engine.model.moe_loading import routed_expert_weights
from engine.model.moe_offload import routed_block
from engine.model.q8_weight import Q8Weight

log = logging.getLogger("strata.engine")

EXPERT_PLACES = ("gpu", "cpu")
# Bytes of one weight as int4.Int4Weight keeps it: half a byte of code, and a bfloat16 scale and zero per group
# of 32 (tests/test_moe_placement.py checks it against a packed model).
INT4_BYTES_PER_WEIGHT = 0.5 + 2 * 2 / 32


def cpu_expert_layers(config: Any, experts: str, cpu_layers: int) -> frozenset[int]:
    """The layers whose routed experts live in host RAM for `--moe-experts experts --moe-cpu-layers cpu_layers`;
    ValueError saying what is wrong and what is expected. `config` is a ModelConfig (or a hybrid model's config,
    which has no experts)."""
    if experts not in EXPERT_PLACES:
        raise ValueError(f"--moe-experts: expected one of {', '.join(EXPERT_PLACES)}, got {experts!r}")
    if cpu_layers < 0:
        raise ValueError(f"--moe-cpu-layers: expected a whole number >= 0, got {cpu_layers}")
    expert_layers = [i for i in range(config.n_layers) if config.is_moe_layer(i)]
    if not expert_layers and any(getattr(config, "parallel_experts", ())):  # Gemma 4: a block beside every MLP
        expert_layers = list(range(config.n_layers))
    if not expert_layers:
        if experts != "gpu" or cpu_layers:
            log.warning("--moe-experts %s --moe-cpu-layers %d ignored: %s has no experts", experts, cpu_layers,
                        config.architecture)
        return frozenset()
    n = config.n_layers
    if experts == "cpu":
        if cpu_layers:
            raise ValueError(f"--moe-cpu-layers {cpu_layers} with --moe-experts cpu: --moe-experts cpu already "
                             "puts every layer's experts on the CPU; give one of them (--moe-experts gpu "
                             f"--moe-cpu-layers N keeps the first N of the {n} layers' experts on the CPU)")
        count = n
    else:
        if cpu_layers > n:
            raise ValueError(f"--moe-cpu-layers {cpu_layers}: the model has {n} layers; expected 0 to {n}")
        count = cpu_layers
    return frozenset(i for i in expert_layers if i < count)


def check_cpu_experts(config: Any, layers: frozenset[int], available: int) -> None:
    """ValueError when experts are to live on the CPU but this PyTorch cannot run them as 4-bit groups, or when
    they would not fit the `available` bytes of host memory."""
    if not layers:
        return
    if not int4.available():
        raise ValueError(f"--moe-experts cpu / --moe-cpu-layers: experts on the CPU are kept as 4-bit groups, "
                         f"and this PyTorch ({torch.__version__}) has no CPU int4 kernels")
    if not int4.fast_here():
        log.warning("experts on the CPU run as 4-bit groups, and this PyTorch's 4-bit CPU kernel is %.0fx slower "
                    "than float32 here (no vectorised kernel for this CPU or build): expect slow experts",
                    int4.kernel_slowdown())
    need = len(layers) * routed_expert_weights(config) * INT4_BYTES_PER_WEIGHT
    if need > available:
        raise ValueError(f"--moe-experts cpu / --moe-cpu-layers: the experts of {len(layers)} layers need about "
                         f"{need / 2**20:.0f} MiB of host RAM as 4-bit groups, only {available / 2**20:.0f} MiB "
                         "is available; place fewer layers on the CPU (--moe-cpu-layers N)")


def arena_bytes(layers: Iterable[Any]) -> int:
    """Bytes of routed-expert weights resident in host RAM (the expert arena) among decoder `layers`: every
    expert of a CPU model, the placed layers' experts of a GPU one; 0 for a dense model."""
    blocks = (routed_block(layer) for layer in layers)
    return sum(b.expert_bytes for b in blocks if b is not None and b.expert_device.type == "cpu")


def describe(layers: Iterable[Any]) -> dict[str, Any]:
    """Where each expert layer's experts are and how they are stored, for the cache identity (K/V computed with
    4-bit experts differs from K/V computed with float ones); empty for a dense model, whose identity keeps its
    old form."""
    placed = [(i, b) for i, layer in enumerate(layers) if (b := routed_block(layer)) is not None]
    if not placed:
        return {}
    return {"experts": [f"{i}:{m.expert_device.type}:{_format(m)}" for i, m in placed]}


def _format(moe: Any) -> str:
    """How an expert block's stacks are stored: float, int4 (one Int4Weight per expert, as quantize_experts makes
    them), q4k / q6k / q8 / mxfp4 (the file's Q4_K, Q6_K, Q8_0 or MXFP4 rows), or gate_up's and down's formats
    apart when they differ."""
    def one(w: Any) -> str:
        if not isinstance(w, list):
            return "float"
        if isinstance(w[0], Q8Weight):
            return "q8"
        return w[0].kind.replace("_", "").lower() if isinstance(w[0], KQuantWeight) else "int4"  # q4k, q6k, mxfp4

    down = one(moe.down)
    gate_up = one(moe.gate_up) if hasattr(moe, "gate_up") else down  # Nemotron-H's experts have up and down only
    return down if gate_up == down else f"{gate_up}/{down}"
