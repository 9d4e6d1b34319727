"""A GGUF file's header: metadata and tensor directory, parsed in one pass over the mapped bytes.

`gguf.GGUFReader` builds numpy views for every part of every metadata item: for a 262K-token vocabulary
(Gemma 3) that is ~800K views and about a minute of CPU before a weight is read. This parser gives the same
values (a plain Python value per key, lists for arrays) from `struct` reads of the mapped header.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

from engine.errors import ModelLoadError

# GGUF value types: struct format of each scalar type; 8 = string, 9 = array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorEntry:
    """One entry of the tensor directory."""

    name: str
    qtype: int  # a gguf.GGMLQuantizationType value
    shape: tuple[int, ...]  # outermost first (GGUF lists the innermost dimension first)
    offset: int  # of its bytes in the file
    n_bytes: int


@dataclass(frozen=True)
class GGUFHeader:
    metadata: dict[str, Any]
    tensors: list[TensorEntry]
    data_offset: int  # where the tensor data starts (the header's size)


class _Cursor:
    def __init__(self, buf: mmap.mmap, path: str) -> None:
        self.buf, self.at, self.path = buf, 0, path

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        if self.at + size > len(self.buf):
            raise ModelLoadError(f"{self.path}: not a readable GGUF file (truncated header)")
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.at)
        self.at += size
        return value

    def string(self) -> str:
        n = self.unpack("Q")
        if self.at + n > len(self.buf):
            raise ModelLoadError(f"{self.path}: not a readable GGUF file (a string runs past the end of the file)")
        text = self.buf[self.at : self.at + n].decode("utf-8", errors="replace")
        self.at += n
        return text

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.unpack("I"), self.unpack("Q")
            if item in _SCALARS:  # one unpack for the whole run
                fmt = f"<{count}{_SCALARS[item]}"
                size = struct.calcsize(fmt)
                if self.at + size > len(self.buf):
                    raise ModelLoadError(f"{self.path}: not a readable GGUF file (an array runs past the end)")
                values = list(struct.unpack_from(fmt, self.buf, self.at))
                self.at += size
                return values
            return [self.value(item) for _ in range(count)]
        raise ModelLoadError(f"{self.path}: not a readable GGUF file (unknown value type {kind})")


def read_header(path: str) -> GGUFHeader:
    """The metadata (keys as `gguf` names them, `GGUF.*` left out) and tensor directory of a GGUF file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if os.path.getsize(path) < 24:
        raise ModelLoadError(f"{path}: not a readable GGUF file (truncated header)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        cur = _Cursor(buf, path)
        if cur.unpack("4s") != b"GGUF":
            raise ModelLoadError(f"{path}: not a GGUF file (bad magic)")
        version = cur.unpack("I")
        if version not in (2, 3):
            raise ModelLoadError(f"{path}: not a readable GGUF file (version {version}; expected 2 or 3)")
        n_tensors, n_kv = cur.unpack("Q"), cur.unpack("Q")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            meta[key] = cur.value(cur.unpack("I"))
        raw: list[tuple[str, tuple[int, ...], int, int]] = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.unpack("Q") for _ in range(cur.unpack("I"))]
            raw.append((name, tuple(reversed(dims)), cur.unpack("I"), cur.unpack("Q")))
        alignment = int(meta.get("general.alignment", 32))
        data_offset = -(-cur.at // alignment) * alignment
    tensors = []
    for name, shape, qtype, offset in raw:
        try:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        except (ValueError, KeyError):
            raise ModelLoadError(f"{path}: tensor {name} has unknown type {qtype}") from None
        n = 1
        for d in shape:
            n *= d
        tensors.append(TensorEntry(name, qtype, shape, data_offset + offset, n // block * size))
    return GGUFHeader(meta, tensors, data_offset)
