"""Derived CPU weights kept on disk (`--weights-cache`): a GGUF model's 4-bit packed projections and output
matrix (and the 8-bit rows of those the file holds with more bits, engine/model/q8_weight.py), so the next start reads them from one file instead of splitting nibbles, re-quantising and packing again
(most of a CPU load: the bundled model's 4 s of weights become ~0.1 s).

A cache file belongs to one GGUF file as it is on disk (absolute path, size, modification time, inode and a hash
of its header bytes: a cheaper identity than re-reading the weights, and any rewrite of the file changes it) and to
the code that derived it (FORMAT below, the 4-bit kernel whose layout the bytes are, torch's version and CPU
capability, whose packing kernel made the aten layout, and the group size). It carries the model's fingerprint from the first load, so a hit reads none of the weights it
replaces. Every tensor is checked against the xxh3 written beside it before any is used; a file that does not
match is removed and the model loads from the GGUF as if there were none. Files are published atomically
(engine/atomic.py) and only the newest KEEP are kept.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time

import torch
import xxhash

from engine import atomic
from engine.model import int4
from engine.model.int4 import Int4Weight
from engine.model.q8_weight import Q8Weight

log = logging.getLogger("strata.model")

FORMAT = 5  # bump when what is derived, or how, changes: older files then simply stop matching (5: Q4_K and
# Q8_0 projections are the file's rows, no longer derived)
KEEP = 3  # cache files kept (the newest used); each is about the size of the model's 4-bit weights
_NAME_RE = re.compile(r"^.+-[0-9a-f]{16}\.int4\.safetensors$")
_TOKENIZER_RE = re.compile(r"^.+-[0-9a-f]{16}\.tokenizer\.json$")


class DerivedWeights:
    """The 4-bit weights of one load: found in the cache folder (a hit), or collected as built and then saved."""

    def __init__(self, folder: str, source: str, header_size: int, options: dict) -> None:
        """`source` is the GGUF file, `header_size` its header's length in bytes (metadata and tensor directory),
        `options` what else shapes the derived bytes (dtype, devices)."""
        self.folder = folder
        self.key = _key(source, header_size, options)
        digest = xxhash.xxh3_64(json.dumps(self.key, sort_keys=True).encode()).hexdigest()
        self.path = os.path.join(folder, f"{_stem(source)}-{digest}.int4.safetensors")
        self.fingerprint: str | None = None  # the model's weights fingerprint, from the file on a hit
        self._found: dict[str, Int4Weight | Q8Weight] = {}
        self._built: dict[str, Int4Weight | Q8Weight] = {}
        self._read()

    @property
    def hit(self) -> bool:
        return self.fingerprint is not None

    def get(self, name: str, shape: tuple[int, int]) -> Int4Weight | Q8Weight | None:
        """The cached weight `name` ("3.wqkv", "lm_head"), or None on a miss."""
        w = self._found.get(name)
        if w is None:
            return None
        if w.shape != shape:  # the key covers the file, so only a bug gets here: convert rather than run wrong
            log.warning("weights cache: %s holds %s as %s, the model wants %s; converting it from the model file",
                        self.path, name, w.shape, shape)
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            return None
        return w

    def put(self, name: str, w: Int4Weight | Q8Weight) -> None:
        """A weight built by this load, saved by `save`."""
        self._built[name] = w

    def save(self, fingerprint: str) -> None:
        """Publish the weights built by this load (nothing on a hit or when none were built); a write error is
        logged and leaves no file under the real name."""
        if self.hit or not self._built:
            return
        from safetensors.torch import save

        tensors: dict[str, torch.Tensor] = {}
        shapes, kinds = {}, {}
        for name, w in self._built.items():
            for part, t in w.state().items():
                tensors[f"{name}.{part}"] = t
            shapes[name] = list(w.shape)
            kinds[name] = "q8" if isinstance(w, Q8Weight) else "int4"
        digests = {name: _digest(t) for name, t in tensors.items()}
        meta = {"strata_weights_cache": str(FORMAT), "key": json.dumps(self.key, sort_keys=True),
                "fingerprint": fingerprint, "shapes": json.dumps(shapes), "kinds": json.dumps(kinds),
                "digests": json.dumps(digests)}
        try:
            os.makedirs(self.folder, exist_ok=True)
            n = atomic.atomic_write(self.path, [save(tensors, metadata=meta)])
        except OSError as e:
            log.warning("weights cache: could not write %s (%s); the next start converts the weights again",
                        self.path, e.strerror or e)
            return
        log.info("weights cache: wrote %s (%.0f MiB)", self.path, n / 2**20)
        _prune(self.folder, keep=self.path, pattern=_NAME_RE)

    def _read(self) -> None:
        if not os.path.isfile(self.path):
            return
        try:
            found, fingerprint = _load(self.path, self.key)
        except (OSError, ValueError) as e:
            log.warning("weights cache: %s refused (%s); converting the weights from the model file", self.path, e)
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            return
        self._found, self.fingerprint = found, fingerprint
        with contextlib.suppress(OSError):
            os.utime(self.path)  # newest used: the last one pruning removes
        log.info("weights cache: %d weights from %s", len(found), self.path)


def _header_hash(source: str, header_size: int) -> str:
    with open(source, "rb") as f:
        return xxhash.xxh3_128(f.read(header_size)).hexdigest()


def _stem(source: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", os.path.splitext(os.path.basename(source))[0])[:64]


def _key(source: str, header_size: int, options: dict) -> dict:
    st = os.stat(source)
    header = _header_hash(source, header_size)
    return {
        "format": FORMAT, "source": os.path.abspath(source), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
        "inode": st.st_ino, "header": header, "torch": torch.__version__,
        "capability": torch.backends.cpu.get_cpu_capability(), "group": int4.GROUP, "kernel": int4.kernel(),
        **options,
    }


def _digest(t: torch.Tensor) -> str:
    return xxhash.xxh3_128(t.contiguous().view(torch.uint8).numpy().data).hexdigest()


def _load(path: str, key: dict) -> tuple[dict[str, Int4Weight | Q8Weight], str]:
    """The weights of a cache file and its fingerprint; ValueError when it is not whole or not this key's."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as handle:
            meta = handle.metadata() or {}
            if meta.get("strata_weights_cache") != str(FORMAT) or meta.get("key") != json.dumps(key, sort_keys=True):
                raise ValueError("written for another model file or engine version")
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 (not a dict)
    except (SafetensorError, RuntimeError) as e:
        raise ValueError(f"not a readable safetensors file: {e}") from None
    try:
        shapes, digests, kinds = (json.loads(meta[k]) for k in ("shapes", "digests", "kinds"))
        fingerprint = meta["fingerprint"]
    except (KeyError, json.JSONDecodeError) as e:
        raise ValueError(f"header incomplete ({e})") from None
    if set(digests) != set(tensors):
        raise ValueError("tensor list does not match the header")
    for name, t in tensors.items():
        if _digest(t) != digests[name]:
            raise ValueError(f"checksum mismatch in {name}")
    parts: dict[str, dict[str, torch.Tensor]] = {name: {} for name in shapes}
    for tensor_name, t in tensors.items():
        name, _, part = tensor_name.rpartition(".")
        if name not in parts:
            raise ValueError(f"tensor {tensor_name} belongs to no weight in the header")
        parts[name][part] = t
    if set(kinds) != set(shapes) or not set(kinds.values()) <= {"int4", "q8"}:
        raise ValueError("weight kinds do not match the header")
    found: dict[str, Int4Weight | Q8Weight] = {
        name: (Q8Weight if kinds[name] == "q8" else Int4Weight).from_state(parts[name], (int(shape[0]), int(shape[1])))
        for name, shape in shapes.items()}
    return found, fingerprint


def _prune(folder: str, keep: str, pattern: re.Pattern[str]) -> None:
    """Remove all but the KEEP newest cache files of `pattern` from `folder`, and temp files a crash left a day ago
    or more."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    files, day_ago = [], time.time() - 86400
    for name in names:
        path = os.path.join(folder, name)
        with contextlib.suppress(OSError):
            if pattern.match(name):
                files.append((os.stat(path).st_mtime_ns, path))
            elif atomic.is_temp_name(name) and os.stat(path).st_mtime < day_ago:  # not one being written now
                os.unlink(path)
    files.sort(reverse=True)
    for _, path in files[KEEP:]:
        if path != keep:
            with contextlib.suppress(OSError):
                os.unlink(path)


class KeptTokenizer:
    """A GGUF model's built tokenizers backend and its fingerprint, kept beside the weights: the tokenizer is
    wholly described by the header's metadata, so the header's bytes (with the tokenizers version that serialises
    it and the version of how this engine builds it, tokenizer.GGUF_TOKENIZER_BUILD) are its key. Checked against an xxh3 of its JSON before use; anything else is rebuilt and written again."""

    def __init__(self, folder: str, source: str, header_size: int) -> None:
        import tokenizers

        self.folder = folder
        from engine.model.tokenizer import GGUF_TOKENIZER_BUILD

        self.key = {"format": FORMAT, "header": _header_hash(source, header_size), "tokenizers": tokenizers.__version__,
                    "build": GGUF_TOKENIZER_BUILD}
        digest = xxhash.xxh3_64(json.dumps(self.key, sort_keys=True).encode()).hexdigest()
        self.path = os.path.join(folder, f"{_stem(source)}-{digest}.tokenizer.json")

    def load(self):  # -> tuple[tokenizers.Tokenizer, str] | None
        """(backend, fingerprint) from the kept file, or None (missing, damaged or another key's: then removed)."""
        if not os.path.isfile(self.path):
            return None
        from tokenizers import Tokenizer as FastTokenizer

        try:
            with open(self.path, encoding="utf-8") as f:
                kept = json.load(f)
            text = kept["tokenizer"]
            if kept.get("key") != self.key or xxhash.xxh3_128(text.encode()).hexdigest() != kept.get("xxh3"):
                raise ValueError("another model's, or damaged")
            backend = FastTokenizer.from_str(text)
            fingerprint = str(kept["fingerprint"])
        except Exception as e:  # noqa: BLE001 - unreadable, not JSON, fields missing, or from_str's own errors
            log.warning("weights cache: tokenizer %s refused (%s); building it from the model file", self.path, e)
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            return None
        with contextlib.suppress(OSError):
            os.utime(self.path)
        return backend, fingerprint

    def save(self, backend, fingerprint: str) -> None:
        """Keep `backend` (a tokenizers.Tokenizer) and its fingerprint; a write error is logged, nothing is left
        under the real name."""
        text = backend.to_str()
        body = json.dumps({"key": self.key, "fingerprint": fingerprint, "xxh3": xxhash.xxh3_128(text.encode()).hexdigest(),
                           "tokenizer": text}, ensure_ascii=False)
        try:
            os.makedirs(self.folder, exist_ok=True)
            atomic.atomic_write(self.path, [body.encode()])
        except OSError as e:
            log.warning("weights cache: could not write %s (%s)", self.path, e.strerror or e)
            return
        _prune(self.folder, keep=self.path, pattern=_TOKENIZER_RE)
