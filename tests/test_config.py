"""The settings table: parsing, bounds, messages, and the flags it generates."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.cli import parse_config
from engine.config import LIVE_SETTINGS, EngineConfig, all_settings, setting_of
from engine.setting import SettingError


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        ("--ctx-size", "12x", 'expected a whole number of tokens from 64 to 1048576, got "12x"'),
        ("--conversation-cache-mib", "-1", "expected a whole number of MiB"),
        ("--conversation-cache-storage", "cloud", "expected one of ram, disk, tiered"),
        ("--conversation-cache-similarity", "1.5", "expected a number from 0 to 0.999"),
        ("--conversation-cache-similarity", "nan", "expected a number"),
        ("--port", "70000", "from 0 to 65535"),
        ("--parallel", "0", "from 1 to 256"),
        ("--dtype", "int8", "expected one of auto, float32, bfloat16, float16"),
    ],
)
def test_bad_flag_is_refused_with_flag_expectation_and_value(flag, value, expected):
    with pytest.raises(SettingError) as info:
        parse_config([flag, value])
    message = str(info.value)
    assert message.startswith(flag + ":"), message
    assert expected in message, message


def test_bad_flag_exits_2_with_one_clear_line():
    proc = subprocess.run(
        [sys.executable, "-m", "engine", "serve", "--conversation-cache-mib", "12x"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        'strata serve: error: --conversation-cache-mib: expected a whole number of MiB from 0 to 16777216, got "12x"'
    )


def test_unknown_flag_exits_2():
    proc = subprocess.run([sys.executable, "-m", "engine", "serve", "--no-such-flag"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--no-such-flag" in proc.stderr


def test_help_documents_every_flag():
    proc = subprocess.run([sys.executable, "-m", "engine", "serve", "--help"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0
    for _, spec, _ in all_settings():
        assert spec.flag in proc.stdout, spec.flag


def test_to_args_round_trips_through_the_cli():
    config = EngineConfig(ctx_size=2048, parallel=3, conversation_cache_storage="disk",
                          conversation_cache_days=2.5, api_key="k", conversation_cache_dir="/tmp/x")
    assert parse_config(config.to_args()) == config


def test_spill_dir_means_tiered_in_that_folder():
    config = parse_config(["--conversation-cache-spill-dir", "/tmp/spill"])
    assert config.conversation_cache_storage == "tiered"
    assert config.cache_dir == "/tmp/spill"


def test_from_mapping_accepts_flags_and_names_and_refuses_unknown():
    config = EngineConfig.from_mapping({"conversation-cache-mib": "100", "parallel": 2})
    assert config.conversation_cache_mib == 100 and config.parallel == 2
    with pytest.raises(SettingError, match="unknown setting 'colour'"):
        EngineConfig.from_mapping({"colour": "blue"})


def test_secret_is_masked_and_live_settings_are_cache_settings():
    assert EngineConfig(api_key="hunter2").public_dict()["api_key"] == "***"
    assert "conversation_cache_storage" in LIVE_SETTINGS and "model" not in LIVE_SETTINGS
    assert all(setting_of(n).group == "cache" for n in LIVE_SETTINGS)


def test_nul_byte_in_a_path_is_refused():
    with pytest.raises(SettingError, match="NUL"):
        parse_config(["--slot-save-path", "a\x00b"])


def test_flag_reference_in_docs_is_up_to_date():
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, os.path.join(root, "tools", "flags_doc.py"), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout


def test_each_setting_declares_its_own_label_and_a_ui_kind():
    from engine.config import all_settings
    from engine.setting import UI_KINDS

    labels = [spec.label for _, spec, _ in all_settings()]
    assert all(labels) and len(set(labels)) == len(labels), "every setting has its own words"
    assert {spec.ui for _, spec, _ in all_settings()} <= set(UI_KINDS)
    assert setting_of("conversation_cache_mib").ui == "size" and setting_of("api_key").ui == "secret"
    assert setting_of("conversation_cache_dir").ui == "folder" and setting_of("model").ui == "model"


def test_cache_settings_defaults_are_the_engine_defaults():
    import dataclasses

    from engine.cache.settings import CacheSettings

    derived = CacheSettings.from_engine_config(EngineConfig())
    assert dataclasses.replace(derived, dir="") == CacheSettings(), "CacheSettings repeats no default of its own"
    assert CacheSettings.from_engine_config(EngineConfig(conversation_cache_write_buffer_mib=3)).spill_queue_bytes \
        == 3 << 20
