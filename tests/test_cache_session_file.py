"""Session files: round trip, interoperable safetensors, and every bad name or bad file refused with a reason."""

from __future__ import annotations

import json
import os
import struct
import sys

import pytest
import torch
from safetensors import safe_open

from engine.cache import SessionFileError, load_session, safe_session_path, save_session
from engine.kv import KVLayout
from tests.test_cache_support import LAYOUT, FakeSlots, conversation, identity


@pytest.fixture
def saved(tmp_path):
    slots = FakeSlots()
    tokens = conversation(1, 123)
    slots.fill(0, tokens)
    kv = slots.kv.read(0, 0, len(tokens))
    path = str(tmp_path / "chat.bin")
    n = save_session(path, identity(), tokens, kv, engine_version="1.2.3")
    assert n == os.path.getsize(path)
    return path, tokens, kv


def test_session_file_round_trips_exactly(saved):
    path, tokens, kv = saved
    got_tokens, got_kv = load_session(path, identity())
    assert got_tokens == tokens and torch.equal(got_kv, kv)
    assert [n for n in os.listdir(os.path.dirname(path))] == ["chat.bin"]  # no temp file left behind


def test_session_file_is_plain_safetensors(saved):
    path, tokens, kv = saved
    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
        assert torch.equal(f.get_tensor("kv"), kv)
        assert f.get_tensor("tokens").tolist() == tokens
    assert meta["engine_version"] == "1.2.3" and meta["format_version"] == "1"
    assert json.loads(meta["identity"])["model"]["architecture"] == "llama"


def test_session_file_does_not_depend_on_block_size(saved):
    path, tokens, _ = saved
    assert load_session(path, identity(block=64))[0] == tokens


def test_bf16_session_round_trips(tmp_path):
    layout = KVLayout(2, 1, 8, torch.bfloat16)
    kv = torch.randn(layout.host_shape(10)).to(torch.bfloat16)
    path = str(tmp_path / "s")
    save_session(path, identity(layout=layout), list(range(10)), kv, engine_version="x")
    assert torch.equal(load_session(path, identity(layout=layout))[1], kv)


@pytest.mark.parametrize(
    "name",
    ["", ".", "..", "../x", "a/b", "/etc/passwd", "a\\b", "x\x00y", "tab\tname", "n" * 256, "é" * 128],
)
def test_bad_filenames_are_refused(tmp_path, name):
    with pytest.raises(ValueError, match="filename"):
        safe_session_path(str(tmp_path), name)


def test_good_filenames_stay_in_the_folder(tmp_path):
    for name in ("chat.bin", "a b c", "..hidden", "n" * 255, "x.y.z"):
        assert os.path.dirname(safe_session_path(str(tmp_path), name)) == str(tmp_path)


@pytest.mark.skipif(sys.platform == "win32", reason="a symlink needs a privilege on Windows (WinError 1314); "
                    "wine makes one it cannot resolve")
def test_symlink_out_of_the_folder_is_refused(tmp_path):
    os.symlink("/etc/hostname", tmp_path / "link")
    with pytest.raises(ValueError, match="outside"):
        safe_session_path(str(tmp_path), "link")


def _expect_refusal(path, match, ident=None):
    with pytest.raises(SessionFileError, match=match):
        load_session(path, ident or identity())


def test_corrupt_payload_byte_is_refused(saved):
    path, _, _ = saved
    with open(path, "r+b") as f:
        f.seek(-100, os.SEEK_END)
        b = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x01]))
    _expect_refusal(path, "corrupt.*checksum")


def test_corrupt_header_byte_is_refused(saved):
    path, _, _ = saved
    with open(path, "rb") as f:
        data = bytearray(f.read())
    i = data.index(b'"n_tokens":"123"') + len('"n_tokens":"')
    data[i] = ord("9")
    with open(path, "wb") as f:
        f.write(data)
    _expect_refusal(path, "corrupt")


def test_truncated_file_is_refused(saved):
    path, _, _ = saved
    size = os.path.getsize(path)
    for keep in (size - 1, size // 2, 4100, 12, 3, 0):
        with open(path, "r+b") as f:
            f.truncate(keep)
        _expect_refusal(path, "truncated|corrupt")


def test_foreign_model_file_is_refused_and_says_what_differs(saved):
    path, _, _ = saved
    other = identity(model={"architecture": "llama", "n_layers": 4, "tokenizer": "tok-2", "weights": "w-1"})
    _expect_refusal(path, "another model.*tokenizer", other)
    other_layout = identity(layout=KVLayout(4, 2, 16, torch.float16))
    _expect_refusal(path, "another model.*dtype", other_layout)


def test_old_format_version_is_refused(saved):
    path, _, _ = saved
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        payload = f.read()
    header["__metadata__"]["format_version"] = "0"
    text = json.dumps(header).encode()
    text += b" " * (n - len(text))
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + payload)
    _expect_refusal(path, "format version")


def test_other_files_are_refused(tmp_path):
    _expect_refusal(str(tmp_path / "missing"), "does not exist")
    os.mkdir(tmp_path / "dir")
    _expect_refusal(str(tmp_path / "dir"), "'dir' is a folder, expected a file")
    (tmp_path / "text").write_text("hello world, not a session file at all")
    _expect_refusal(str(tmp_path / "text"), "corrupt|truncated")
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(3)}, str(tmp_path / "other.safetensors"))
    _expect_refusal(str(tmp_path / "other.safetensors"), "not a Strata session file")


def test_a_folder_is_named_as_one_whatever_the_platform_says_when_it_is_opened(tmp_path, monkeypatch):
    """Windows answers "Permission denied" when a folder is opened as a file: the folder is told apart first."""
    import builtins

    real_open = builtins.open

    def open_as_windows_does(path, *args, **kwargs):
        if os.path.isdir(path):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    os.mkdir(tmp_path / "chat.bin")
    monkeypatch.setattr(builtins, "open", open_as_windows_does)
    _expect_refusal(str(tmp_path / "chat.bin"), "'chat.bin' is a folder, expected a file")
    slots, tokens = FakeSlots(), conversation(2, 40)
    slots.fill(0, tokens)
    with pytest.raises(SessionFileError, match="'chat.bin' is a folder, expected a file"):
        save_session(str(tmp_path / "chat.bin"), identity(), tokens, slots.kv.read(0, 0, len(tokens)),
                     engine_version="t")
    assert os.listdir(tmp_path) == ["chat.bin"] and os.listdir(tmp_path / "chat.bin") == []  # nothing written


def test_save_refuses_mismatched_kv(tmp_path):
    with pytest.raises(ValueError, match="expected"):
        save_session(
            str(tmp_path / "x"), identity(), [1, 2, 3], torch.zeros(LAYOUT.host_shape(4)), engine_version="t"
        )
    assert os.listdir(tmp_path) == []


def test_a_slot_file_restored_is_parked_without_the_slots_last_request_name_or_pin(tmp_path):
    """The slot's last request said what its conversation is called, its priority and its pin; the session file's
    contents are another conversation, and a park of them must not carry B's name or keep them pinned."""
    from engine.cache.attrs import ConvAttrs
    from engine.config import EngineConfig
    from engine.runtime.engine import Engine
    from engine.runtime.requests import GenerationRequest, SamplingParams
    from tests.model_fixtures import write_tiny_model

    config = EngineConfig(model=write_tiny_model(tmp_path, "llama"), devices="cpu", ctx_size=512, parallel=1,
                          conversation_cache_storage="ram", conversation_cache_mib=64,
                          conversation_cache_min_free_mib=0, conversation_cache_block_tokens=16,
                          slot_save_path=str(tmp_path / "slots"))
    engine = Engine.from_config(config)

    def answer(request_id: str, prompt: list[int], attrs: ConvAttrs = ConvAttrs()) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=4)
        assert [e for e in engine.submit(GenerationRequest(request_id, prompt, params, attrs=attrs))][-1].error is None

    try:
        a = [(i * 7) % 200 + 5 for i in range(100)]
        answer("a", a)
        engine.call(lambda: engine.save_slot(0, "a.bin")).result()
        engine.call(lambda: engine.purge_cache("all")).result()
        answer("b", [(i * 13) % 200 + 5 for i in range(100)],
               ConvAttrs(priority="high", pinned=True, name="B's private chat", client="clientB"))
        engine.call(lambda: engine.purge_cache("all")).result()  # B lives in the slot only
        engine.call(lambda: engine.restore_slot(0, "a.bin")).result()
        answer("c", [(i * 17) % 200 + 5 for i in range(100)])  # parks the session file's contents
        [parked] = engine.call(engine.cache_conversations).result()
        assert parked["tokens"] >= len(a) and not parked["pinned"] and parked["priority"] == "normal", parked
        assert parked["name"] != "B's private chat" and parked["client"] != "clientB", parked
    finally:
        engine.close()
