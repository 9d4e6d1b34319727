"""What a next-token (MTP) layer's tensors become when mtp_layer.MtpBlock builds it, and what they will take.

The kept tensors (mtp.KeptTensor: a GGUF tensor's own bytes, a safetensors tensor in its dtype) are decoded to
float32 one at a time as the block asks for them (`decoder`), never all at once. With 4-bit experts (the main
model's weights int4 on the CPU) the routed experts are held as the main model's CPU experts are
(moe_loading.build_sparse_moe's `kquant=` and `groups=`): a stack the file holds as Q4_K / Q6_K / Q8_0 stays in
its blocks (`kquant`), a Q4_0 / Q4_1 / Q4_K one gives its own 4-bit groups, anything else is quantised to 4-bit
groups one expert at a time (`groups`), so no float copy of the whole expert stack is ever made: DeepSeek-V3's
256 experts of 7168 x 2048 would be ~45 GiB as float32, ~7 GiB as 4-bit groups.
"""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING

import torch

from engine.errors import ModelLoadError
from engine.model import gguf_dequant, int4, kquant_weight

if TYPE_CHECKING:
    from collections.abc import Callable

    from engine.model.mtp import KeptTensor, MtpLayer

# The expert matrices of a layer (routed: stacked or one per expert; the shared expert): what 4-bit experts hold
# as 4-bit groups or the file's blocks. The router, its bias and every other tensor stay float32.
_EXPERT_MATRIX = re.compile(r"experts\.(gate|up|down|gate_up)|expert\.\d+\.(gate|up|down)|shared\.(gate|up|down)")
_STACKS = ("experts.gate", "experts.up", "experts.down", "experts.gate_up")
# A routed stack's group while it is built: 32 one-byte codes, a float32 scale and minimum.
_BUILT_GROUP_BYTES = int4.GROUP + 8


def float_weight(t: KeptTensor) -> torch.Tensor:
    """A kept tensor as float32 on the CPU (a GGUF one decoded from its own bytes)."""
    if t.kind.startswith("torch."):
        return t.data.to(torch.float32)
    return gguf_dequant.dequantize(t.name, t.data, _qtype(t), t.shape)


def held_bytes(layer: MtpLayer, int4_experts: bool) -> int:
    """The most host RAM MtpBlock takes for the layer, while it is built and after: float32 for every tensor,
    except, with `int4_experts` (where the 4-bit kernels run), the expert matrices: a stack in a K-quant (or Q8_0)
    the native kernels multiply takes its file's bytes; any other matrix is held as 4-bit groups (20 bytes per 32
    values: codes, scale and minimum). The routed stacks are built one phase at a time (moe_loading's packing):
    gate and up, each first made whole as a byte per code with a float scale and minimum per group (40 bytes per 32
    values) and joined by rows into one more such copy; then down alone (or a fused gate_up alone). The largest
    phase comes on top of all that is held (a little more than the peak: down is held only after gate and up's
    phase). GLM-4.5-Air's MTP experts (128 of 4096 x 1408): ~8.3 GiB as float32, ~1.3 held as 4-bit groups, ~4.7
    counted for the build (gate and up's phase). A 64-expert layer of 512 x 2048 grew the process by 436 MiB where
    this counts 440."""
    int4_experts = int4_experts and int4.available()  # as MtpBlock decides: float32 where the kernels do not run
    total = 0
    built = {"gate_up": 0, "down": 0, "fused": 0}  # the groups each build phase makes whole first
    for key, t in layer.items():
        count = 1
        for n in t.shape:
            count *= n
        if int4_experts and _EXPERT_MATRIX.fullmatch(key) and len(t.shape) >= 2 and t.shape[-1] % int4.GROUP == 0:
            if t.kind in kquant_weight.CLASSES and len(t.shape) == 3 and kquant_weight.available():
                total += t.data.numel()
                continue
            groups = count // int4.GROUP
            total += groups * int4.Q4_BLOCK_BYTES
            if not key.startswith("shared."):
                phase = "fused" if key.endswith("gate_up") else "down" if key.endswith(".down") else "gate_up"
                built[phase] += groups * (2 if phase == "gate_up" else 1)  # gate and up: joined into a copy
        else:
            total += 4 * count
    return total + max(built.values()) * _BUILT_GROUP_BYTES


def decoder(layer: MtpLayer, prefix: str) -> Callable[[str], torch.Tensor | None]:
    """A getter of the layer's tensors by key (`prefix` + the kept key), each decoded to float32 when asked."""

    def get(key: str) -> torch.Tensor | None:
        t = layer.get(key.removeprefix(prefix)) if key.startswith(prefix) else None
        return None if t is None else float_weight(t)

    return get


def kquant(layer: MtpLayer, prefix: str) -> Callable[[list[str], tuple[str, ...]], tuple[str, list[torch.Tensor]] | None]:
    """moe_loading's KQuantGetter over the layer's GGUF tensors: their own bytes as [..., rows, row bytes] when
    every one of `keys` is a GGUF tensor of the same type among `kinds` that the native kernels multiply."""

    def find(keys: list[str], kinds: tuple[str, ...]) -> tuple[str, list[torch.Tensor]] | None:
        found = [layer.get(key.removeprefix(prefix)) for key in keys]
        if any(t is None for t in found) or not kquant_weight.available():
            return None
        tensors = [t for t in found if t is not None]
        kind = tensors[0].kind
        if kind not in kinds or kind not in kquant_weight.CLASSES or any(t.kind != kind for t in tensors):
            return None
        return kind, [t.data.view(*t.shape[:-1], kquant_weight.row_bytes(t.shape[-1], kind)) for t in tensors]

    return find


def groups(layer: MtpLayer, prefix: str, where: str) -> Callable[[str], int4.Groups | None]:
    """moe_loading's GroupsGetter for the layer's expert stacks: a Q4_0 / Q4_1 / Q4_K stack's own groups, any
    other stack (or an HF folder's experts, one tensor each) quantised one expert at a time; None for a key the
    layer does not hold as an expert stack."""

    def find(key: str) -> int4.Groups | None:
        name = key.removeprefix(prefix)
        if not key.startswith(prefix) or name not in _STACKS:
            return None
        t = layer.get(name)
        if t is not None:
            if len(t.shape) != 3:
                return None  # build_sparse_moe reads it as a tensor and refuses its shape
            if not t.kind.startswith("torch.") and _qtype(t) in gguf_dequant.Q4_GROUPED:
                return gguf_dequant.q4_groups(t.name, t.data, _qtype(t), t.shape)
            return _quantised(t.shape[0], functools.partial(_one_expert, t), t.shape[1:], where, t.name)
        if name == "experts.gate_up":
            return None  # an HF folder's experts are apart: gate and up are asked for
        part = name.split(".", 1)[1]
        per_expert: list[KeptTensor] = []
        while (one := layer.get(f"expert.{len(per_expert)}.{part}")) is not None:
            per_expert.append(one)
        if not per_expert:
            return None
        shape = per_expert[0].shape
        if len(shape) != 2:
            raise ModelLoadError(f"{where}: expert.0.{part} has shape {shape}, expected 2 dimensions")
        return _quantised(len(per_expert), lambda j: float_weight(per_expert[j]), shape, where, f"expert.*.{part}")

    return find


def _quantised(n: int, expert: Callable[[int], torch.Tensor], shape: tuple[int, ...], where: str,
               name: str) -> int4.Groups:
    """4-bit groups of a stack of `n` experts that come as float32 one at a time (`expert(j)`): only one expert's
    float values exist at once."""
    rows, cols = shape
    if cols % int4.GROUP:
        raise ModelLoadError(f"{where}: {name}'s experts ({rows} x {cols}) cannot be held as 4-bit groups")
    codes = torch.empty(n, rows, cols, dtype=torch.uint8)
    scale, minimum = torch.empty(n, rows, cols // int4.GROUP), torch.empty(n, rows, cols // int4.GROUP)
    for j in range(n):
        w = expert(j)
        if tuple(w.shape) != (rows, cols):
            raise ModelLoadError(f"{where}: {name} expert {j} has shape {tuple(w.shape)}, expected {(rows, cols)}")
        codes[j], scale[j], minimum[j] = int4.quantize_groups(w)
    return codes, scale, minimum


def _one_expert(t: KeptTensor, j: int) -> torch.Tensor:
    """Expert j's matrix of a stacked tensor [experts, rows, cols] as float32: a GGUF stack's experts are
    consecutive runs of whole blocks (each row is), so its bytes are sliced and only that run decoded."""
    if t.kind.startswith("torch."):
        return t.data[j].to(torch.float32)
    per = t.data.numel() // t.shape[0]
    return gguf_dequant.dequantize(t.name, t.data[j * per : (j + 1) * per], _qtype(t), t.shape[1:])


def _qtype(t: KeptTensor) -> int:
    from gguf import GGMLQuantizationType

    return int(GGMLQuantizationType[t.kind])
