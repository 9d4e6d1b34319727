"""The lean GGUF header reader: the same metadata and tensor directory as gguf-py's reader, and a clear error
for a file that is not a whole GGUF header."""

from __future__ import annotations

import shutil
import struct

import gguf
import pytest

from engine.errors import ModelLoadError
from engine.model import embedded_model_path
from engine.model.gguf_header import read_gguf_header
from tests.model_fixtures import write_tiny_gguf


def _gguf_py_metadata(reader) -> dict:
    """Every metadata field gguf-py decodes, as plain Python values: the reference the lean reader must match."""
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            out[key] = field.contents()
        except Exception:  # a field gguf cannot decode is left out
            continue
    return out


def _as_gguf_py_reads(path: str):
    reader = gguf.GGUFReader(path)
    directory = [(t.name, int(t.tensor_type), tuple(int(n) for n in reversed(t.shape.tolist())),
                  int(t.data_offset), int(t.n_bytes)) for t in reader.tensors]
    return _gguf_py_metadata(reader), directory, reader.data_offset


@pytest.mark.parametrize("which", ["bundled", "tiny"])
def test_the_header_reads_as_gguf_py_reads_it(tmp_path, which):
    path = embedded_model_path() if which == "bundled" else write_tiny_gguf(tmp_path, "llama")
    meta, directory, data_offset = _as_gguf_py_reads(path)
    header = read_gguf_header(path)
    assert header.metadata == meta and header.data_offset == data_offset
    assert [(t.name, int(t.qtype), t.shape, t.offset, t.n_bytes) for t in header.tensors] == directory
    assert {type(v) for v in header.metadata.values()} <= {str, int, float, bool, list}


def test_a_damaged_header_is_a_clear_error(tmp_path):
    good = write_tiny_gguf(tmp_path, "llama")
    with open(good, "rb") as f:
        data = f.read()
    cases = {
        "truncated": (data[:4000], "not a readable GGUF file"),
        "magic": (b"GGUX" + data[4:], "no GGUF magic"),
        "version": (data[:4] + struct.pack("<I", 1) + data[8:], "GGUF version 1"),
        "count": (data[:8] + struct.pack("<Q", 1 << 40) + data[16:], "implausible counts"),
        "tiny": (data[:10], "too short for a GGUF header"),
    }
    for name, (content, words) in cases.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(content)
        with pytest.raises(ModelLoadError, match=words) as info:
            read_gguf_header(str(path))
        assert str(path) in str(info.value)
    copy = tmp_path / "copy.gguf"
    shutil.copy(good, copy)
    assert read_gguf_header(str(copy)).tensors


def test_a_tensor_of_implausible_dimensions_is_refused_before_its_size_wraps(tmp_path):
    import gguf
    import numpy as np

    path = str(tmp_path / "huge.gguf")  # 2^62 x 8 values: int64 products wrap, and the size came out negative
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor_info("output_norm.weight", [2**62, 8], np.dtype(np.float32), 32,
                           raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"output_norm.weight: dimensions .* are not plausible"):
        read_gguf_header(path)


@pytest.mark.parametrize("field, value", [("embedding_length", "abc"), ("attention.head_count", 0),
                                          ("block_count", -2)])
def test_a_shape_field_of_the_wrong_kind_is_refused_naming_it(tmp_path, field, value):
    from engine.model.gguf_loading import gguf_config

    header = read_gguf_header(write_tiny_gguf(tmp_path, "llama"))
    meta = {**header.metadata, f"llama.{field}": value}
    with pytest.raises(ModelLoadError, match=f"metadata llama.{field} is {value!r}; expected a positive whole"):
        gguf_config(meta, {t.name for t in header.tensors}, "x.gguf")
