"""The desktop settings file and what it hands the engine: sizes and values refused with reasons, the file's
round trip (only changed values kept), a damaged or newer file, the environment's overrides, atomic writes and the
debounced autosave, the platform folders, and the command line the settings make (the API key and a store's
password read from variables)."""

from __future__ import annotations

import json
import os
import sys

os.environ["QT_QPA_PLATFORM"] = "offscreen"

import pytest

from desktop.files import atomic_write
from desktop.settings import (
    SCHEMA_VERSION,
    AutoSaver,
    Paths,
    SettingsStore,
    Source,
    command_line,
    format_mib,
    parse_mib,
    secret_variables,
)
from engine.config import EngineConfig, setting_of
from engine.setting import SettingError


def test_budget_accepts_mib_and_gib_and_refuses_with_reason():
    spec = setting_of("conversation_cache_mib")
    assert parse_mib("4096", spec) == 4096
    assert parse_mib("4 GiB", spec) == 4096
    assert parse_mib("1.5G", spec) == 1536
    assert parse_mib(" 512 MiB ", spec) == 512
    with pytest.raises(SettingError, match=r'--conversation-cache-mib: expected a size in MiB or GiB.*"12x"'):
        parse_mib("12x", spec)
    with pytest.raises(SettingError, match=r"--conversation-cache-mib: expected a whole number of MiB from 0 to"):
        parse_mib("-5", spec)
    assert format_mib(4096) == "4 GiB" and format_mib(300) == "300 MiB"


def test_bad_values_are_refused_with_the_reason_and_not_stored(tmp_path):
    store = SettingsStore(tmp_path / "s.json", environ={})
    with pytest.raises(SettingError, match=r'--port: expected a whole number from 0 to 65535, got "70000"'):
        store.set("port", "70000")
    with pytest.raises(SettingError, match="one of ram, disk, tiered"):
        store.set("conversation_cache_storage", "cloud")
    assert store.value("port") == 8080
    assert store.source("port") is Source.DEFAULT
    store.set("port", "9000")
    assert store.value("port") == 9000 and store.source("port") is Source.FILE


def test_round_trip_keeps_only_changed_values(tmp_path):
    path = tmp_path / "cfg" / "s.json"
    store = SettingsStore(path, environ={})
    store.set("conversation_cache_storage", "tiered")
    store.set("conversation_cache_mib", 2048)
    store.set("port", "8080")  # the default: not written
    store.set_pref("close_to_tray", False)
    assert store.save() is True
    assert store.save() is False, "nothing changed: nothing written"
    data = json.loads(path.read_text())
    assert data["schema"] == SCHEMA_VERSION
    assert data["engine"] == {"conversation_cache_mib": 2048, "conversation_cache_storage": "tiered"}
    again = SettingsStore(path, environ={})
    assert again.load() == []
    assert again.engine_config() == store.engine_config()
    assert again.prefs.close_to_tray is False
    assert again.pending_text() is None, "a file just read is not rewritten"


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"engine": {}}', '{"schema": 1, "engine": []}'])
def test_damaged_file_is_kept_aside_and_defaults_used(tmp_path, content):
    path = tmp_path / "s.json"
    path.write_text(content)
    store = SettingsStore(path, environ={})
    messages = store.load()
    assert len(messages) == 1 and "damaged" in messages[0] and "defaults are used" in messages[0]
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("s.json.damaged-")]
    assert len(aside) == 1 and aside[0].read_text() == content
    assert not path.exists()
    assert store.engine_config() == EngineConfig()
    store.save()
    assert json.loads(path.read_text())["schema"] == SCHEMA_VERSION


def test_one_bad_value_in_the_file_drops_only_that_value(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"schema": 1, "engine": {"port": 99999, "conversation_cache_mib": 100,
                                                        "no_such_thing": 1}}))
    store = SettingsStore(path, environ={})
    messages = store.load()
    assert any("--port" in m and "default is used" in m for m in messages)
    assert any("no_such_thing" in m for m in messages)
    assert store.value("port") == 8080 and store.value("conversation_cache_mib") == 100


def test_newer_schema_is_read_with_a_message(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"schema": SCHEMA_VERSION + 1, "engine": {"port": 9001}, "app": {}}))
    store = SettingsStore(path, environ={})
    assert any("newer" in m for m in store.load())
    assert store.value("port") == 9001


def test_environment_overrides_the_file_and_says_so(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"schema": 1, "engine": {"port": 9001}}))
    store = SettingsStore(path, environ={"STRATA_PORT": "9100", "STRATA_CONVERSATION_CACHE_MIB": "lots"})
    store.load()
    assert store.value("port") == 9100
    assert store.source("port") is Source.ENV
    assert "STRATA_PORT" in store.describe_source("port")
    with pytest.raises(SettingError, match="STRATA_PORT"):
        store.set("port", 9200)
    assert any("STRATA_CONVERSATION_CACHE_MIB ignored" in m for m in store.messages)
    store.save()
    assert json.loads(path.read_text())["engine"] == {"port": 9001}, "the environment is never written to the file"


# The shown command line is a POSIX shell's (`"$STRATA_API_KEY"`), checked by running it in `sh`.
@pytest.mark.skipif(sys.platform == "win32", reason="no POSIX sh on Windows; the line is written for one")
def test_command_line_masks_the_api_key_with_a_working_placeholder():
    import subprocess

    config = EngineConfig(api_key="s3cret", conversation_cache_storage="disk", conversation_cache_dir="/a b")
    text = command_line(config, shell="posix")
    assert text.startswith("strata serve ")
    assert "s3cret" not in text and '--api-key "$STRATA_API_KEY"' in text
    assert "--conversation-cache-dir '/a b'" in text
    assert "s3cret" in command_line(config, mask_secrets=False)
    # Pasted into a real shell with the variable set, the line gives the engine exactly the configured arguments.
    line = command_line(config, program="printf '%s\\n'", shell="posix")
    out = subprocess.run(["sh", "-c", line], env={"STRATA_API_KEY": "s3cret", "PATH": os.environ["PATH"]},
                         capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == config.to_args()


def test_command_line_for_powershell_quotes_its_way_and_reads_the_key_from_the_environment():
    """On Windows the line is pasted into PowerShell: single quotes (a quote inside doubled), $env:NAME."""
    from desktop.settings import set_variable_hint

    config = EngineConfig(api_key="s3cret", conversation_cache_dir="C:\\Users\\Ann Lee\\it's here")
    text = command_line(config, shell="powershell")
    assert "s3cret" not in text and "--api-key $env:STRATA_API_KEY" in text
    assert "--conversation-cache-dir 'C:\\Users\\Ann Lee\\it''s here'" in text
    assert "--devices 'cuda:0,cuda:1'" in command_line(EngineConfig(devices="cuda:0,cuda:1"), shell="powershell"), \
        "a comma would make a PowerShell array"
    assert set_variable_hint("STRATA_API_KEY", "powershell") == "$env:STRATA_API_KEY = '…'"
    assert set_variable_hint("STRATA_API_KEY", "posix") == "export STRATA_API_KEY=…"


def test_atomic_write_replaces_whole_file(tmp_path):
    path = tmp_path / "f.json"
    atomic_write(path, "one")
    atomic_write(path, "two")
    assert path.read_text() == "two"
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]


def test_a_settings_save_waits_out_a_moments_hold_on_the_file_and_a_lasting_one_loses_nothing(tmp_path, monkeypatch):
    """Windows refuses to replace a file another program holds open (a scanner reading it): the save tries again;
    held for good, it fails saying so, the old file whole and no temporary file left."""
    from desktop import files
    from tests.test_autostart import Refusing

    monkeypatch.setattr(files, "SHARING_VIOLATIONS", True)
    path = tmp_path / "s.json"
    store = SettingsStore(path, environ={})
    store.set("conversation_cache_mib", 2048)
    replace = Refusing(os.replace, path, times=3)
    monkeypatch.setattr(os, "replace", replace)
    assert store.save() is True and replace.refused == 3
    assert json.loads(path.read_text())["engine"] == {"conversation_cache_mib": 2048}
    monkeypatch.setattr(files, "SHARING_RETRIES", 2)
    monkeypatch.setattr(os, "replace", Refusing(os.replace.real, path, times=1000))
    store.set("conversation_cache_mib", 4096)
    with pytest.raises(PermissionError, match=r"s\.json could not be changed through 2 tries"):
        store.save()
    assert json.loads(path.read_text())["engine"] == {"conversation_cache_mib": 2048}
    assert [p.name for p in tmp_path.iterdir()] == ["s.json"]
    assert store.pending_text() is not None  # still to be written


def test_paths_default_to_platform_folders():
    paths = Paths.default()
    assert paths.settings_file.name == "desktop-settings.json"
    assert paths.pid_file.name == "engine.pid"


def test_command_line_reads_a_store_url_with_a_password_from_a_variable():
    with_password = EngineConfig(conversation_cache_remote="redis://team:hunter2@127.0.0.1:6379/0")
    text = command_line(with_password, shell="posix")
    assert "hunter2" not in text and '--conversation-cache-remote "$STRATA_CONVERSATION_CACHE_REMOTE"' in text
    assert secret_variables(with_password) == ["STRATA_CONVERSATION_CACHE_REMOTE"]
    without = EngineConfig(conversation_cache_remote="redis://127.0.0.1:6379/0")
    assert "--conversation-cache-remote redis://127.0.0.1:6379/0" in command_line(without, shell="posix")


def test_autosave_is_debounced_and_written_off_the_ui_thread(qtbot, tmp_path):
    import threading

    from desktop.client import Dispatcher

    dispatcher = Dispatcher()
    writers: list[str] = []
    submit = dispatcher.submit

    def spy(work, callback=None):
        def wrapped():
            writers.append(threading.current_thread().name)
            return work()
        submit(wrapped, callback)

    store = SettingsStore(tmp_path / "s.json", environ={})
    saver = AutoSaver(store, spy, delay_ms=200)
    for port in range(9000, 9010):
        store.set("port", port)
        saver.schedule()
    with qtbot.waitSignal(saver.saved, timeout=3000):
        pass
    assert len(writers) == 1 and writers[0] != threading.main_thread().name
    assert json.loads((tmp_path / "s.json").read_text())["engine"] == {"port": 9009}
    dispatcher.close()


def test_a_slow_background_save_never_lands_after_a_newer_one(qtbot, tmp_path, monkeypatch):
    """The first save's write takes a while (a slow fsync); a newer change and the quit's flush come meanwhile: the
    file ends holding the newest settings, whatever order the writes finish in."""
    import threading

    from desktop import settings as settings_module
    from desktop.client import Dispatcher
    from desktop.settings import AutoSaver

    write, first = settings_module.atomic_write, threading.Event()

    def slow_first(path, text):
        if not first.is_set():
            first.set()
            threading.Event().wait(0.5)
        write(path, text)

    monkeypatch.setattr(settings_module, "atomic_write", slow_first)
    dispatcher = Dispatcher()
    store = SettingsStore(tmp_path / "s.json", environ={})
    store.load()
    saver = AutoSaver(store, dispatcher.submit, delay_ms=0)
    try:
        store.set("port", 9001)
        saver.schedule()
        qtbot.waitUntil(first.is_set, timeout=5000)  # the slow write of 9001 is under way
        store.set("port", 9002)
        saver.flush()  # the quit's
    finally:
        dispatcher.close(wait=True)
    assert json.loads((tmp_path / "s.json").read_text(encoding="utf-8"))["engine"]["port"] == 9002
