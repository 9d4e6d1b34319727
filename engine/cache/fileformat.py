"""The one file format of parked K/V: safetensors with a checksummed header and per-tensor checksums.

Layout (standard safetensors, readable by `safetensors.safe_open`): an 8-byte little-endian header length, a JSON
header padded with spaces so the payload starts on a 4096-byte boundary, then the raw tensors back to back. The
header's `__metadata__` (all strings) carries the magic, format version, engine version, identity, and
`checksums` (xxh3-128 of each tensor's bytes) plus `meta_checksum` (xxh3-128 of the metadata and tensor table), so
the header is verified on its own (an index reads only headers) and each tensor before any of its bytes is used.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xxhash

from engine.cache.identity import FORMAT_VERSION, canonical_json

MAGIC = "strata-kv"
ALIGN = 4096
MAX_HEADER = 64 << 20
READ_CHUNK = 1 << 20

_DTYPE_NAMES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
}
_DTYPES = {name: dtype for dtype, name in _DTYPE_NAMES.items()}


class FileFormatError(Exception):
    """A file is not a readable Strata K/V file; `reason` is one word for logs and counters."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason  # "truncated", "corrupt", "alien" (not ours), "foreign" (other model), "version"


@dataclass(frozen=True, slots=True)
class TensorEntry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # offset in the payload
    end: int


@dataclass(frozen=True, slots=True)
class Header:
    meta: dict[str, str]
    tensors: dict[str, TensorEntry]
    data_start: int
    file_size: int

    def json_meta(self, name: str) -> object:
        """A metadata value that holds JSON, decoded (the metadata checksum already vouched for it)."""
        return json.loads(self.meta[name])


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous tensor, without a copy."""
    assert t.is_contiguous() and t.device.type == "cpu", "file tensors must be contiguous host tensors"
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]  # ndarray is a buffer


def encode_header(tensors: Sequence[tuple[str, torch.Tensor]], meta: dict[str, str]) -> bytes:
    """The header (length prefix + padded JSON) for `tensors` in this order, with checksums filled in."""
    table: dict[str, dict] = {}
    checksums: dict[str, str] = {}
    offset = 0
    for name, t in tensors:
        size = t.numel() * t.element_size()
        table[name] = {
            "dtype": _DTYPE_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        checksums[name] = xxhash.xxh3_128_hexdigest(tensor_bytes(t))
        offset += size
    meta = {
        **meta,
        "magic": MAGIC,
        "format_version": str(FORMAT_VERSION),
        "checksums": canonical_json(checksums),
    }
    meta["meta_checksum"] = _meta_checksum(meta, table)
    text = json.dumps({"__metadata__": meta, **table}, separators=(",", ":")).encode()
    pad = (-(8 + len(text))) % ALIGN
    text += b" " * pad
    return struct.pack("<Q", len(text)) + text


def _meta_checksum(meta: dict[str, str], table: dict[str, dict]) -> str:
    body = {k: v for k, v in meta.items() if k != "meta_checksum"}
    return xxhash.xxh3_128_hexdigest(canonical_json({"meta": body, "tensors": table}).encode())


def file_chunks(header: bytes, tensors: Sequence[tuple[str, torch.Tensor]]) -> list[bytes | memoryview]:
    """Buffers to write, in order, for a file made of `header` and `tensors`."""
    return [header, *(tensor_bytes(t) for _, t in tensors)]


def read_header(f, file_size: int | None = None) -> Header:
    """Parse and verify the header of an open binary file (position is left after the header)."""
    if file_size is None:
        file_size = os.fstat(f.fileno()).st_size
    raw = f.read(8)
    if len(raw) < 8:
        raise FileFormatError("truncated", f"file of {file_size} bytes ends inside the header length")
    (n,) = struct.unpack("<Q", raw)
    if n > MAX_HEADER:
        raise FileFormatError("corrupt", f"header length {n} is not plausible (not a Strata K/V file?)")
    text = f.read(n)
    if len(text) < n and (8 + n) % ALIGN:  # ours are padded to the boundary: the length field itself is damaged
        raise FileFormatError("corrupt", f"header length {n} runs past the file's {file_size} bytes and does not end "
                              f"on a {ALIGN}-byte boundary (the length is damaged)")
    if len(text) < n:
        raise FileFormatError(
            "truncated", f"file ends inside the header ({file_size} bytes, header needs {8 + n}): cut short, or its "
            "length field damaged")
    try:
        doc = json.loads(text)
        if not isinstance(doc, dict):
            raise ValueError("header is not a JSON object")
        meta = doc.pop("__metadata__", {})
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise ValueError("metadata is not a string map")
    except (ValueError, KeyError, TypeError) as exc:
        raise FileFormatError("corrupt", f"header is not valid safetensors JSON ({exc})") from None
    if meta.get("magic") != MAGIC:
        raise FileFormatError("alien", "not a Strata K/V file (no strata-kv magic in its metadata)")
    # the version decides how the rest is checked, so it is read before the checksum
    if meta.get("format_version") != str(FORMAT_VERSION):
        raise FileFormatError(
            "version", f"format version {meta.get('format_version')} (this engine reads {FORMAT_VERSION})"
        )
    if meta.get("meta_checksum") != _meta_checksum(meta, doc):
        raise FileFormatError("corrupt", "header checksum mismatch (the file was altered or damaged)")
    tensors: dict[str, TensorEntry] = {}
    try:
        for name, entry in doc.items():
            begin, end = (int(x) for x in entry["data_offsets"])
            tensors[name] = TensorEntry(
                _DTYPES[entry["dtype"]], tuple(int(s) for s in entry["shape"]), begin, end
            )
    except (KeyError, TypeError, ValueError) as exc:
        raise FileFormatError("corrupt", f"bad tensor table in header ({exc})") from None
    data_start = 8 + n
    payload = max((e.end for e in tensors.values()), default=0)
    for name, e in tensors.items():
        size = e.dtype.itemsize
        for s in e.shape:
            size *= s
        if e.end - e.begin != size or e.begin < 0:
            raise FileFormatError("corrupt", f"tensor {name}: offsets do not match its shape")
    if file_size < data_start + payload:
        raise FileFormatError(
            "truncated", f"file has {file_size} bytes, its header describes {data_start + payload}"
        )
    if file_size > data_start + payload:
        raise FileFormatError(
            "corrupt", f"file has {file_size} bytes, its header describes {data_start + payload}"
        )
    return Header(meta, tensors, data_start, file_size)


def read_tensor(f, header: Header, name: str, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Read tensor `name` into host memory and verify its checksum; raises FileFormatError on a mismatch."""
    entry = header.tensors.get(name)
    if entry is None:
        raise FileFormatError("corrupt", f"no tensor {name!r} in the file")
    if out is None:
        out = torch.empty(entry.shape, dtype=entry.dtype)
    assert tuple(out.shape) == entry.shape and out.dtype == entry.dtype and out.is_contiguous()
    view = tensor_bytes(out)
    f.seek(header.data_start + entry.begin)
    h = xxhash.xxh3_128()
    got = 0
    while got < len(view):
        # hash each chunk while it is still in the CPU cache: one pass over memory instead of two
        n = f.readinto(view[got : got + READ_CHUNK])
        if not n:
            raise FileFormatError("truncated", f"tensor {name}: file ended after {got} of {len(view)} bytes")
        h.update(view[got : got + n])
        got += n
    want = json.loads(header.meta["checksums"]).get(name)
    if h.hexdigest() != want:
        raise FileFormatError(
            "corrupt", f"tensor {name}: checksum mismatch (the file was altered or damaged)"
        )
    return out
