"""What a parked conversation must match to be restored here: the model as this engine runs it (weights, their
format and kernels, the decode step's arithmetic, the tokenizer, where experts live), the K/V layout and block size,
and what the slot memory parks beside the K/V."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from engine.cache.identity import CacheIdentity
from engine.kv import KVLayout
from engine.model import moe_placement
from engine.runtime.memory import SlotMemory

if TYPE_CHECKING:
    from engine.model.build import LoadedModel
    from engine.runtime.protocols import Model


def int4_kernel(model: Model, weights_format: str) -> str:
    """The 4-bit CPU kernel this engine's weights go through ("blocks" or "aten", engine/model/int4.py), or ""
    when none do: int4 weights on the CPU, or experts kept in host RAM (always 4-bit)."""
    from engine.model import int4

    on_cpu = all(torch.device(d).type == "cpu" for d, _, _ in model.stages)
    experts = moe_placement.describe(model.layers).get("experts", ())
    if (weights_format == "int4" and on_cpu) or any(e.endswith(":cpu:int4") for e in experts):
        return int4.kernel() or ""
    return ""


def cache_identity(loaded: LoadedModel, weights_format: str, kernel: str, layout: KVLayout, block_tokens: int,
                   memory: SlotMemory) -> CacheIdentity:
    """The identity of `loaded` as the engine runs it (`kernel`: int4_kernel's answer)."""
    from engine.model.kquant_weight import KQuantWeight
    from engine.model.q8_output import Q8Output
    from engine.model.q8_weight import Q8Weight

    model = loaded.model

    def count(kind: type) -> int:
        return sum(isinstance(getattr(layer, name, None), kind) for layer in model.layers
                   for name in ("wqkv", "wo", "w_gate_up", "w_down"))

    return CacheIdentity(
        model={
            **loaded.config.describe(),
            "weights": loaded.fingerprint,
            "weights_format": weights_format,  # int4 weights give other K/V than float ones
            # and the two 4-bit kernels other K/V than each other (engine/model/int4.py)
            **({"int4_kernel": kernel} if kernel else {}),
            # an output matrix read from the file's Q8_0 blocks rather than 4-bit groups
            **({"output": "Q8_0"} if isinstance(model.lm_head, Q8Output) else {}),
            # projections kept as 8-bit rows because the file holds them with more than 4 bits
            **({"eight_bit_weights": eight} if (eight := count(Q8Weight)) else {}),
            # projections multiplied in the file's own K-quant rows rather than converted (kquant_weight.py)
            **({"kquant_weights": n} if (n := count(KQuantWeight)) else {}),
            # decoded tokens' K/V from step.c's arithmetic rather than PyTorch's
            **({"decode_step": "native"} if model.own_decode_arithmetic else {}),
            "tokenizer": loaded.tokenizer.fingerprint,
            **moe_placement.describe(model.layers),  # experts' device and format (MoE models)
        },
        layout=layout,
        block_tokens=block_tokens,
        # a hybrid model's recurrent state (parked beside the attention K/V), a sliding-window one's window
        **memory.identity(),
    )


def session_identity(identity: CacheIdentity) -> CacheIdentity:
    """What a session file must match: the cache identity, but every layer's K/V (a slot file holds all)."""
    return dataclasses.replace(identity, window=None, local_layers=()) if identity.local_layers else identity
