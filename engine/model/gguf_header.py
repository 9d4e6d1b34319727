"""A lean reader of a GGUF file's header: its metadata and its tensor directory, nothing else.

gguf-py's `GGUFReader` builds numpy views of every field part as it parses (hundreds of thousands for a 49K-token
vocabulary and its merges), which took 2.4 s on a quiet machine and 9-10 s on a busy one for the bundled 98 MB
file. The loader needs only the decoded values and each tensor's name, type, shape and place, so this module
parses them straight from a memory map with `struct` (one pass, strings decoded once) and closes the map.

The format (GGUF v2 and v3, little-endian): magic `GGUF`, version (uint32), tensor count and metadata count
(uint64); each metadata item: key (uint64 length + UTF-8), value type (uint32), value (a scalar, a string, or
an array: item type, uint64 count, items); each tensor: name, dimension count (uint32), dimensions (uint64,
innermost first), type (uint32), offset (uint64) from the data section, which starts at the first multiple of
`general.alignment` (default 32) after the directory. Values come back as `GGUFReader`'s `contents()` gives
them: Python numbers, bools, str, and lists for arrays. A file that does not parse is a `ModelLoadError`.
"""

from __future__ import annotations

import codecs
import functools
import math
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.errors import ModelLoadError

MAGIC = b"GGUF"
_SCALARS: dict[int, str] = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 10: "<u8", 11: "<i8", 12: "<f8"}
_U64 = struct.Struct("<Q")
_MAX_COUNT = 1 << 32  # items in one array, tensors, metadata items: beyond this a count is garbage
_MAX_DIMS = 8


@dataclass(frozen=True)
class GGUFTensor:
    """What loading needs of one entry of a GGUF tensor directory."""

    name: str
    qtype: int  # a gguf.GGMLQuantizationType (an IntEnum)
    shape: tuple[int, ...]  # outermost first (GGUF lists the innermost dimension first)
    offset: int  # of its bytes in the file
    n_bytes: int


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    metadata: dict[str, Any]
    tensors: list[GGUFTensor]
    data_offset: int  # where the tensor data starts: the header, metadata and directory are the bytes before


class _Cursor:
    """Reads little-endian values from a buffer, refusing to run past its end."""

    def __init__(self, buf: Any, size: int) -> None:
        self.buf, self.size, self.pos = buf, size, 0

    def take(self, fmt: str) -> Any:
        n = struct.calcsize(fmt)
        if self.pos + n > self.size:
            raise ValueError(f"the header ends at byte {self.size}, inside a value at byte {self.pos}")
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += n
        return value

    def count(self, what: str, item_bytes: int = 1) -> int:
        n = self.take("Q")
        if n > _MAX_COUNT or self.pos + n * item_bytes > self.size:
            raise ValueError(f"{what} count {n} at byte {self.pos - 8} is not plausible")
        return n

    def string(self) -> str:
        n = self.count("string length")
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return bytes(raw).decode("utf-8", errors="replace")

    def strings(self, n: int) -> list[str]:
        """`n` strings in a row (a vocabulary, its merges: ~100K for a small model), in one tight loop."""
        buf, pos, size = self.buf, self.pos, self.size
        out: list[str] = []
        length_at, append, decode = _U64.unpack_from, out.append, codecs.utf_8_decode
        for _ in range(n):
            if pos + 8 > size:
                raise ValueError(f"the header ends at byte {size}, inside a value at byte {pos}")
            (length,) = length_at(buf, pos)
            pos += 8
            if length > _MAX_COUNT or pos + length > size:
                raise ValueError(f"string length count {length} at byte {pos - 8} is not plausible")
            append(decode(buf[pos : pos + length], "replace", True)[0])
            pos += length
        self.pos = pos
        return out

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype = self.take("I")
            if itype in _NUMPY:  # numbers: one numpy read, not one struct call per item
                dtype = np.dtype(_NUMPY[itype])
                n = self.count("array", dtype.itemsize)
                items = np.frombuffer(self.buf, dtype, n, self.pos).tolist()
                self.pos += n * dtype.itemsize
                return items
            n = self.count("array")
            if itype == _STRING:
                return self.strings(n)
            return [self.value(itype) for _ in range(n)]
        raise ValueError(f"unknown metadata value type {vtype} at byte {self.pos - 4}")


MAX_VALUES = 1 << 40  # values in one tensor: far above any model (a 1T-parameter one holds it whole)

def _parse(buf: Any, size: int, path: str) -> GGUFHeader:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    c = _Cursor(buf, size)
    if bytes(buf[:4]) != MAGIC:
        raise ValueError("no GGUF magic at the start of the file")
    c.pos = 4
    version = c.take("I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version}; this loader reads versions 2 and 3 (little-endian)")
    n_tensors, n_meta = c.take("Q"), c.take("Q")
    if n_tensors > _MAX_COUNT or n_meta > _MAX_COUNT:
        raise ValueError(f"implausible counts: {n_tensors} tensors, {n_meta} metadata items")
    meta: dict[str, Any] = {}
    for _ in range(n_meta):
        key = c.string()
        meta[key] = c.value(c.take("I"))
    raw: list[tuple[str, tuple[int, ...], int, int]] = []
    for _ in range(n_tensors):
        name = c.string()
        n_dims = c.take("I")
        if n_dims > _MAX_DIMS:
            raise ValueError(f"tensor {name}: {n_dims} dimensions")
        dims = tuple(c.take("Q") for _ in range(n_dims))
        raw.append((name, dims, c.take("I"), c.take("Q")))
    alignment = meta.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment {alignment!r} is not a power of two")
    data_offset = -(-c.pos // alignment) * alignment
    tensors = []
    for name, dims, code, offset in raw:
        try:
            qtype = GGMLQuantizationType(code)
            block, type_bytes = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ValueError(f"tensor {name}: unknown type {code}") from None
        n = math.prod(int(d) for d in dims)  # Python ints: a damaged dimension must not wrap around int64
        if (dims and min(dims) <= 0) or n > MAX_VALUES:
            raise ValueError(f"tensor {name}: dimensions {list(dims)} are not plausible (damaged?)")
        if n % block:
            raise ValueError(f"tensor {name}: {n} values are not whole blocks of {block}")
        tensors.append(GGUFTensor(name, qtype, tuple(reversed(dims)), data_offset + offset, n // block * type_bytes))
    return GGUFHeader(version, meta, tensors, data_offset)


def read_gguf_header(path: str) -> GGUFHeader:
    """The header of a GGUF file (the last one read is reused while the file is unchanged)."""
    stat = os.stat(path)
    return _read_header(os.path.abspath(path), stat.st_size, stat.st_mtime_ns)


def forget_headers() -> None:
    """Drop the reused header (its vocabulary lists are megabytes of Python objects) once a load is done."""
    _read_header.cache_clear()


@functools.lru_cache(maxsize=1)
def _read_header(path: str, size: int, mtime_ns: int) -> GGUFHeader:
    try:
        with open(path, "rb") as f:
            if size < 24:
                raise ValueError(f"{size} bytes is too short for a GGUF header")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                view = memoryview(mm)
                try:
                    return _parse(view, size, path)
                finally:
                    view.release()  # the map closes with no view of it left
    except (ValueError, struct.error, OSError) as e:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from None
