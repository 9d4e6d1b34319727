"""Next-token (MTP) layers (GLM-4.x MoE, DeepSeek-V3, GLM-4.7-Flash, Qwen3-Next, Qwen3.5): loaded and kept as the
file holds them (mtp_layer.py runs one).

A GLM-4.5/4.6/4.7 checkpoint (and a DeepSeek-V3 or GLM-4.7-Flash one, the attention then latent) carries `num_nextn_predict_layers` (one) extra layers after the last decoder layer
(`model.layers.<n_layers>.*` in HF folders, `blk.<n_layers>.*` in a GGUF whose `block_count` includes them):
a MoE decoder layer plus `eh_proj` (the [embedding; hidden] -> hidden projection), `enorm`, `hnorm`,
`shared_head.norm` and optionally `shared_head.head` / `embed_tokens`. They predict the token after the next
one, for speculative decoding. The loaders keep each MTP layer's tensors
(every canonical key of that layer, the decoder part under the same keys as a decoder layer's and the MTP part
as `nextn.*`) in `CausalLM.mtp`, as the file stores them: a GGUF tensor's own bytes in its own type (no
dequantised copy: the MTP layer of GLM-4.5-Air is a full MoE layer), a safetensors tensor in its own dtype,
both on the CPU. mtp_layer.MtpBlock builds a runnable layer from them (gguf_dequant.dequantize for the GGUF kind).
Qwen3-Next and Qwen3.5 folders keep theirs under `mtp.*` (`QWEN_HF_NAMES`, read by engine/model/hybrid/loader.py),
their norms kept as the decoder's are loaded (1 + w, the family's zero-centred RMSNorm), so the block reads
every norm weight as it is.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.errors import ModelLoadError

if TYPE_CHECKING:
    from engine.model.gguf_header import GGUFTensor

log = logging.getLogger("strata.engine")

# HF names (after `model.layers.<i>.`) and GGUF names (after `blk.<i>.`) of the MTP-only tensors -> canonical
# keys (the GGUF names without the suffix).
HF_NAMES = {
    "eh_proj.weight": "nextn.eh_proj", "enorm.weight": "nextn.enorm", "hnorm.weight": "nextn.hnorm",
    "shared_head.norm.weight": "nextn.shared_head_norm", "shared_head.head.weight": "nextn.shared_head_head",
    "embed_tokens.weight": "nextn.embed_tokens",
}
GGUF_NAMES = {f"{key}.weight": key for key in HF_NAMES.values()}
# Qwen3-Next / Qwen3.5 folders hold their next-token layer apart, under `mtp.` (llama.cpp's converter renames
# them to these same nextn keys): the MTP-only tensors, and `mtp.layers.<j>.*` a decoder layer of the model's.
QWEN_HF_NAMES = {
    "mtp.fc.weight": "nextn.eh_proj", "mtp.pre_fc_norm_embedding.weight": "nextn.enorm",
    "mtp.pre_fc_norm_hidden.weight": "nextn.hnorm", "mtp.norm.weight": "nextn.shared_head_norm",
}
# What an MTP layer cannot do without (llama.cpp's glm4-moe requires them too).
REQUIRED = ("nextn.eh_proj", "nextn.enorm", "nextn.hnorm")


@dataclass(frozen=True, slots=True)
class KeptTensor:
    """One tensor of an MTP layer as the file holds it."""

    name: str  # the file's tensor name
    kind: str  # a torch dtype ("torch.bfloat16") for safetensors, a GGML type name ("Q4_K") for GGUF
    shape: tuple[int, ...]  # the tensor's shape (for GGUF, in the engine's row-major order)
    data: torch.Tensor  # safetensors: the values; GGUF: the file's bytes (uint8), on the CPU


MtpLayer = dict[str, KeptTensor]  # canonical key within the layer ("q", "experts.gate", "nextn.eh_proj") -> tensor


def qwen_hf_key(name: str, n_layers: int, layer_key: Callable[[str], str | None]) -> str | None:
    """The canonical key ("4.nextn.eh_proj", "4.q") of a Qwen `mtp.*` tensor name, the layer numbered after the
    `n_layers` decoder layers (`layer_key`: a decoder layer's name after "model.layers.<i>." -> its key), or None."""
    if name in QWEN_HF_NAMES:
        return f"{n_layers}.{QWEN_HF_NAMES[name]}"
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["mtp", "layers"] and parts[2].isdecimal():
        key = layer_key(parts[3])
        return None if key is None else f"{n_layers + int(parts[2])}.{key}"
    return None


def count_layers(n_layers: int, keys: list[str]) -> int:
    """How many layers past the `n_layers` decoder layers the canonical `keys` name (a file's MTP layers)."""
    return len({int(k.split(".", 1)[0]) for k in keys if k.split(".", 1)[0].isdecimal()} - set(range(n_layers)))


def layer_keys(n_layers: int, mtp_layers: int, keys: list[str]) -> list[list[str]]:
    """For each MTP layer (after the `n_layers` decoder layers), the canonical keys a file holds of it ("4.q",
    "4.nextn.eh_proj"), or [] for every layer when the file lacks one's required tensors (a file converted
    without them: nothing is kept, the model runs as it does)."""
    out = []
    for j in range(mtp_layers):
        prefix = f"{n_layers + j}."
        found = sorted(k for k in keys if k.startswith(prefix))
        if any(prefix + r not in found for r in REQUIRED):
            return []
        out.append(found)
    return out


def read_gguf_tensor(t: GGUFTensor, f: io.BufferedIOBase, path: str) -> KeptTensor:
    """A GGUF tensor's own bytes, read from the open file `f`, in its own type."""
    from gguf import GGMLQuantizationType

    data = torch.empty(t.n_bytes, dtype=torch.uint8)
    f.seek(t.offset)
    # numpy's stubs give ndarray the buffer protocol only from Python 3.12 on; it has it on 3.11 too.
    if f.readinto(memoryview(data.numpy())) != data.numel():  # type: ignore[arg-type]
        raise ModelLoadError(f"{path}: truncated: tensor {t.name} ends past the end of the file")
    return KeptTensor(t.name, GGMLQuantizationType(t.qtype).name, tuple(t.shape), data)


def report_kept(layers: tuple[MtpLayer, ...], path: str) -> None:
    """Log what was kept (host RAM that holds weights the engine does not run yet)."""
    if layers:
        size = sum(t.data.nbytes for layer in layers for t in layer.values())
        log.info("%s: kept %d next-token (MTP) layer(s), %d tensors, %.1f MiB in host RAM (run by --spec mtp)", path,
                 len(layers), sum(len(layer) for layer in layers), size / 2**20)
