"""A Hugging Face folder's files as every HF loader reads them (dense, mixture-of-experts and hybrid models): its
safetensors files (from the index or the folder), each checked against its size before use, the fingerprint of
config and headers, the tokenizer, and the tensors by canonical key."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable

import xxhash

from engine.errors import ModelLoadError
from engine.model.tokenizer import Tokenizer, TokenizerError


def safetensors_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({e})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ModelLoadError(f"{index}: weight_map: expected an object of tensor names to file names")
        files = sorted(set(weight_map.values()))
        for name in files:
            if not os.path.isfile(os.path.join(folder, name)):
                raise ModelLoadError(f"{os.path.join(folder, name)}: listed in the index but missing")
        return [os.path.join(folder, n) for n in files]
    files = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no .safetensors files (and no model.safetensors.index.json)")
    return [os.path.join(folder, n) for n in files]


def safetensors_header(path: str) -> bytes:
    """The 8-byte length and JSON header of a safetensors file; ModelLoadError if the file is short or bad."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelLoadError(f"{path}: truncated safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ModelLoadError(f"{path}: truncated safetensors file (header of {n} bytes, file of {size})")
        header = f.read(n)
    try:
        meta = json.loads(header)
    except ValueError:
        raise ModelLoadError(f"{path}: safetensors header is not valid JSON") from None
    if not isinstance(meta, dict):
        raise ModelLoadError(f"{path}: safetensors header: expected a JSON object, got {type(meta).__name__}")
    for name, entry in meta.items():
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if name != "__metadata__" and not (isinstance(offsets, list) and len(offsets) == 2
                                           and all(isinstance(o, int) and o >= 0 for o in offsets)):
            raise ModelLoadError(f"{path}: safetensors header: tensor {name!r} has no valid data_offsets "
                                 "(expected [begin, end] byte offsets)")
    end = max((v["data_offsets"][1] for k, v in meta.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise ModelLoadError(
            f"{path}: truncated safetensors file: tensors need {8 + n + end} bytes, the file has {size}"
        )
    return head + header


def header_fingerprint(description: dict, files: list[str]) -> xxhash.xxh3_128:
    """The start of a folder's fingerprint: the config, then each file's name, size and safetensors header (the
    weights' bytes are added as they are read)."""
    h = xxhash.xxh3_128()
    h.update(json.dumps(description, sort_keys=True).encode())
    for file in files:
        h.update(os.path.basename(file).encode())
        h.update(struct.pack("<Q", os.path.getsize(file)))
        h.update(safetensors_header(file))
    return h


def folder_tokenizer(folder: str) -> Tokenizer:
    try:
        return Tokenizer.from_hf_folder(folder)
    except TokenizerError as e:
        raise ModelLoadError(str(e)) from None


def open_tensors(files: list[str], canonical: Callable[[str], str | None]) -> tuple[dict, dict[str, tuple[str, str]]]:
    """Each file opened once, and where each canonical weight key lives: {key: (file, tensor name)}."""
    from safetensors import safe_open

    handles = {}
    where: dict[str, tuple[str, str]] = {}
    for file in files:
        try:
            handle = safe_open(file, framework="pt")
        except Exception as e:
            raise ModelLoadError(f"{file}: not a readable safetensors file ({e})") from None
        handles[file] = handle
        for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
            key = canonical(name)
            if key is not None:
                where[key] = (file, name)
    return handles, where
