"""Checks and transforms of a GGUF file's tensors that every GGUF loader shares (dense, mixture-of-experts and
hybrid models): the tensor directory checked against the file before a byte is read, and llama.cpp's q/k row order
undone."""

from __future__ import annotations

import os

import torch

from engine.errors import ModelLoadError
from engine.model import gguf_dequant
from engine.model.gguf_header import GGUFTensor


def unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving of q/k rows so RoPE uses the rotate-half convention."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def check_gguf_tensors(path: str, directory: list[GGUFTensor], used: dict[str, GGUFTensor]) -> None:
    """Refuse, before any tensor is read, a file whose tensor directory does not match its data: a tensor that
    runs into the next one or past the end of the file, a type this loader cannot decode, a shape that is not
    whole blocks."""
    file_size = os.path.getsize(path)
    ordered = sorted(directory, key=lambda t: t.offset)
    for t, after in zip(ordered, [*ordered[1:], None], strict=True):
        end = t.offset + t.n_bytes
        if end > file_size:
            raise ModelLoadError(f"{path}: truncated: tensor {t.name} ends past the end of the file")
        if after is not None and end > after.offset:
            raise ModelLoadError(
                f"{path}: corrupt tensor directory: tensor {t.name} ({gguf_dequant.type_name(t.qtype)}, shape "
                f"{t.shape}, {t.n_bytes} bytes) runs into tensor {after.name}"
            )
    for t in used.values():
        try:
            expected = gguf_dequant.tensor_bytes(t.name, t.qtype, t.shape)
        except ModelLoadError as e:
            raise ModelLoadError(f"{path}: {e}") from None
        assert expected == t.n_bytes, (t.name, expected, t.n_bytes)  # gguf sizes a tensor the same way
