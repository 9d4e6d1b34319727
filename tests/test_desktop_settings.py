"""Settings: validation with reasons, the file round-trip, a damaged file, sources, autosave, the Settings tab."""

from __future__ import annotations

import json
import os
import sys

os.environ["QT_QPA_PLATFORM"] = "offscreen"

import pytest

from desktop.settings import (
    SCHEMA_VERSION,
    AutoSaver,
    Paths,
    SettingsStore,
    Source,
    atomic_write,
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


def test_settings_tab_shows_the_command_line_whole_and_copies_it_without_the_key(qtbot, tmp_path):
    from PySide6.QtGui import QGuiApplication

    from desktop.client import Dispatcher
    from desktop.settings import set_variable_hint
    from desktop.settings_tab import SettingsTab

    dispatcher = Dispatcher()
    store = SettingsStore(tmp_path / "s.json", environ={})
    tab = SettingsTab(store, AutoSaver(store, dispatcher.submit), dispatcher.submit)
    qtbot.addWidget(tab)
    tab.resize(700, 600)
    tab.show()
    assert not tab.command_note.isVisibleTo(tab), "no key: nothing to explain"
    long_dir = "/srv/" + "very-long-folder-name/" * 8 + "parked"
    tab.set_text("conversation_cache_dir", long_dir)
    tab.set_text("api_key", "s3cret")
    expected = command_line(store.engine_config())
    assert tab.command.text() == expected and long_dir in expected
    qtbot.waitUntil(lambda: tab.command.document().blockCount() == 1 and tab.command.document().lineCount() > 1)
    assert tab.command.horizontalScrollBar().maximum() == 0, "wrapped to the width, never cut or scrolled sideways"
    # The note is in the words of this platform's shell (PowerShell's `$env:` on Windows, `export` elsewhere).
    assert tab.command_note.isVisibleTo(tab) and set_variable_hint("STRATA_API_KEY") in tab.command_note.text()
    tab.copy_button.click()
    assert QGuiApplication.clipboard().text() == expected and "s3cret" not in expected
    dispatcher.close()


def test_atomic_write_replaces_whole_file(tmp_path):
    path = tmp_path / "f.json"
    atomic_write(path, "one")
    atomic_write(path, "two")
    assert path.read_text() == "two"
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]


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


def test_settings_tab_validates_as_you_type_and_autosaves(qtbot, tmp_path):
    from desktop.client import Dispatcher
    from desktop.settings_tab import SettingsTab

    dispatcher = Dispatcher()
    store = SettingsStore(tmp_path / "s.json", environ={"STRATA_HOST": "127.0.0.1"})
    store.load()
    saver = AutoSaver(store, dispatcher.submit, delay_ms=50)
    tab = SettingsTab(store, saver, dispatcher.submit)
    qtbot.addWidget(tab)

    tab.set_text("port", "80x")
    row = tab.rows["port"]
    assert row.error == 'Port must be a whole number from 0 to 65535, not "80x".', "plain words, not the flag"
    assert row.caption.text() == row.error
    assert row.caption.toolTip() == '--port: expected a whole number from 0 to 65535, got "80x"', "the flag's text"
    assert store.value("port") == 8080
    assert "value(s) not accepted" in tab.pending.text()

    tab.set_text("port", "8181")
    assert row.error == "" and store.value("port") == 8181
    assert row.caption.text() == "changed from the default (8080) · applies after a restart"

    tab.set_text("conversation_cache_mib", "2 GiB")
    assert store.value("conversation_cache_mib") == 2048
    assert "applies live" in tab.rows["conversation_cache_mib"].caption.text()
    assert "--conversation-cache-mib 2048" in tab.command.text() and "--port 8181" in tab.command.text()

    tab.set_text("conversation_cache_storage", "tiered")
    assert store.value("conversation_cache_storage") == "tiered"

    assert not tab.rows["host"].editor.isEnabled(), "set by the environment: locked"
    assert "STRATA_HOST" in tab.rows["host"].caption.text()

    with qtbot.waitSignal(saver.saved, timeout=3000):
        pass
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["engine"] == {"conversation_cache_mib": 2048, "conversation_cache_storage": "tiered", "port": 8181}

    tab.reset("port")
    assert store.source("port") is Source.DEFAULT and tab.rows["port"].text() == "8080"
    dispatcher.close()


def test_settings_tab_reports_folder_not_writable(qtbot, tmp_path):
    from desktop.client import Dispatcher
    from desktop.settings_tab import SettingsTab

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    target = str(blocker / "cache")  # under a regular file: no one can create it, root included
    dispatcher = Dispatcher()
    store = SettingsStore(tmp_path / "s.json", environ={})
    tab = SettingsTab(store, AutoSaver(store, dispatcher.submit), dispatcher.submit)
    qtbot.addWidget(tab)
    tab.set_text("conversation_cache_dir", target)
    qtbot.waitUntil(lambda: "not writable" in tab.rows["conversation_cache_dir"].caption.text(), timeout=3000)
    qtbot.waitUntil(lambda: "free on disk" in (tab.rows["conversation_cache_disk_mib"].info.text()), timeout=3000)
    dispatcher.close()


def test_paths_default_to_platform_folders():
    paths = Paths.default()
    assert paths.settings_file.name == "desktop-settings.json"
    assert paths.pid_file.name == "engine.pid"


def test_start_at_login_checkbox_writes_and_removes_the_entry(qtbot, tmp_path):
    from desktop.autostart import Autostart
    from desktop.client import Dispatcher
    from desktop.settings_tab import SettingsTab

    dispatcher = Dispatcher()
    store = SettingsStore(tmp_path / "s.json", environ={})
    autostart = Autostart(platform="linux", folder=tmp_path / "autostart", command=["strata-desktop"])
    tab = SettingsTab(store, AutoSaver(store, dispatcher.submit), dispatcher.submit, autostart)
    qtbot.addWidget(tab)
    wait_ms = 15_000  # PowerShell or wine on a busy machine: seconds
    qtbot.waitUntil(tab.login_box.isEnabled, timeout=wait_ms)
    assert not tab.login_box.isChecked()
    # The box is off while the worker writes; it comes back when the change is done (the file is read only then:
    # on Windows a read that holds the file while the worker removes it is a sharing violation, retried there).
    tab.login_box.setChecked(True)
    qtbot.waitUntil(tab.login_box.isEnabled, timeout=wait_ms)
    assert autostart.is_enabled() and tab.login_box.isChecked() and autostart.read() == ["strata-desktop", "--hidden"]
    tab.login_box.setChecked(False)
    qtbot.waitUntil(tab.login_box.isEnabled, timeout=wait_ms)
    assert not autostart.is_enabled() and not tab.login_box.isChecked(), tab.result.text()
    dispatcher.close()


def _wheel(widget, steps: int = -1) -> None:
    """A real wheel event over the middle of `widget`, as the mouse sends it."""
    from PySide6.QtCore import QPoint, QPointF, Qt
    from PySide6.QtGui import QWheelEvent
    from PySide6.QtWidgets import QApplication

    centre = QPointF(widget.rect().center())
    event = QWheelEvent(centre, QPointF(widget.mapToGlobal(centre.toPoint())), QPoint(0, 0), QPoint(0, 120 * steps),
                        Qt.MouseButton.NoButton, Qt.KeyboardModifier.NoModifier, Qt.ScrollPhase.NoScrollPhase, False)
    QApplication.sendEvent(widget, event)


def test_wheel_over_an_unfocused_combo_box_scrolls_the_page_and_changes_nothing(qtbot, tmp_path):
    from PySide6.QtWidgets import QComboBox, QScrollArea

    from desktop.client import Dispatcher
    from desktop.settings_tab import SettingsTab

    dispatcher = Dispatcher()
    store = SettingsStore(tmp_path / "s.json", environ={})
    saver = AutoSaver(store, dispatcher.submit, delay_ms=50)
    tab = SettingsTab(store, saver, dispatcher.submit)
    qtbot.addWidget(tab)
    tab.resize(900, 400)  # shorter than the page: it scrolls
    tab.show()
    qtbot.waitExposed(tab)
    scroll = tab.findChild(QScrollArea)
    bar = scroll.verticalScrollBar()
    assert bar.maximum() > 0
    combos = [r.editor for r in tab.rows.values() if isinstance(r.editor, QComboBox)]
    assert {c.objectName() for c in combos} >= {"conversation_cache_storage", "dtype", "log_level"}
    for combo in combos:
        before = combo.currentIndex()
        scroll.ensureWidgetVisible(combo)
        assert not combo.hasFocus()
        _wheel(combo, -1)
        _wheel(combo, +1)
        assert combo.currentIndex() == before, f"{combo.objectName()} changed under an unfocused wheel"
    assert store.values == {}
    qtbot.wait(150)
    assert not (tmp_path / "s.json").exists(), "nothing was saved"
    _wheel(combos[0], +1)  # the page still scrolls under the pointer
    bar.setValue(0)
    _wheel(combos[0], -1)
    assert bar.value() > 0, "the wheel over an unfocused combo box scrolls the page"
    combos[0].setFocus()
    qtbot.waitUntil(combos[0].hasFocus, timeout=2000)
    before = combos[0].currentIndex()
    _wheel(combos[0], -1)
    assert combos[0].currentIndex() != before, "a focused combo box still takes the wheel"
    dispatcher.close()


def test_half_typed_values_are_never_saved_and_the_hint_follows_the_text(qtbot, tmp_path):
    from PySide6.QtCore import Qt

    from desktop.client import Dispatcher
    from desktop.settings_tab import SETTLE_MS, SettingsTab

    dispatcher = Dispatcher()
    path = tmp_path / "s.json"
    store = SettingsStore(path, environ={"STRATA_CONVERSATION_CACHE_STORAGE": "disk"})  # the disk budget is used
    saver = AutoSaver(store, dispatcher.submit, delay_ms=50)
    tab = SettingsTab(store, saver, dispatcher.submit)
    qtbot.addWidget(tab)
    tab.show()
    row = tab.rows["conversation_cache_disk_mib"]
    default = store.value("conversation_cache_disk_mib")
    row.editor.setFocus()
    row.editor.selectAll()
    qtbot.keyClicks(row.editor, "12.5")  # "1", "12", "12." are all whole numbers on the way
    assert row.error == ('Disk budget must be a size from 0 MiB to 1 PiB, in whole MiB or in GiB (e.g. 4096 or 4 GiB),'
                         ' not "12.5".')
    assert row.info.text() == "", "no figure beside a refused value"
    qtbot.wait(SETTLE_MS + 300)
    assert store.value("conversation_cache_disk_mib") == default, "nothing half-typed was stored"
    assert not path.exists(), "nothing was saved"

    row.editor.selectAll()
    qtbot.keyClicks(row.editor, "-5")
    assert row.error and row.info.text() == "" and "GiB" not in row.info.text()
    row.editor.selectAll()
    qtbot.keyClicks(row.editor, "3 GiB")
    assert row.error == "" and row.info.text().startswith("= 3 GiB"), "the hint says what the text says"
    assert store.value("conversation_cache_disk_mib") == default, "still typing: not stored yet"
    with qtbot.waitSignal(tab.committed, timeout=SETTLE_MS + 2000):
        pass  # a pause: the editing settled
    assert store.value("conversation_cache_disk_mib") == 3072
    qtbot.waitUntil(lambda: path.exists(), timeout=3000)
    assert json.loads(path.read_text())["engine"] == {"conversation_cache_disk_mib": 3072}

    port = tab.rows["port"]
    port.editor.setFocus()
    port.editor.selectAll()
    qtbot.keyClicks(port.editor, "9090")
    qtbot.keyClick(port.editor, Qt.Key.Key_Return)  # Enter settles at once
    assert store.value("port") == 9090
    dispatcher.close()


def test_settings_are_labelled_in_words_and_refusals_never_show_a_flag(qtbot, tmp_path):
    from PySide6.QtWidgets import QLabel

    from desktop.client import Dispatcher
    from desktop.settings import HIDDEN_SETTINGS
    from desktop.settings_tab import SettingsTab
    from desktop.settings_words import LABELS
    from engine.config import all_settings

    shown = [name for name, _, _ in all_settings() if name not in HIDDEN_SETTINGS]
    assert [n for n in shown if n not in LABELS] == [], "every setting has its own label"
    dispatcher = Dispatcher()
    store = SettingsStore(tmp_path / "s.json", environ={})
    tab = SettingsTab(store, AutoSaver(store, dispatcher.submit), dispatcher.submit)
    qtbot.addWidget(tab)
    texts = {label.text() for label in tab.findChildren(QLabel)}
    assert "Weights on the CPU" in texts and "Disk write buffer" in texts
    assert not any(t.lower() in ("cpu weights", "write buffer mib") or "_" in t for t in texts if len(t) < 40)
    for name, text in (("port", "eighty"), ("conversation_cache_disk_mib", "-5"), ("threads", "-1"),
                       ("conversation_cache_similarity", "2"), ("ctx_size", ""), ("parallel", "0")):
        tab.rows[name].editor.setText(text)
        error = tab.rows[name].error
        assert error and "--" not in error and error.startswith(LABELS[name]), (name, error)
        assert tab.rows[name].caption.toolTip().startswith("--"), "the flag's own text is one hover away"
    assert tab.rows["conversation_cache_disk_mib"].error.startswith("Disk budget must be a size from 0 MiB to 1 PiB")
    dispatcher.close()


def test_budgets_the_storage_mode_does_not_use_are_greyed(qtbot, tmp_path):
    from desktop.client import Dispatcher
    from desktop.settings_tab import SettingsTab

    dispatcher = Dispatcher()
    store = SettingsStore(tmp_path / "s.json", environ={})
    tab = SettingsTab(store, AutoSaver(store, dispatcher.submit), dispatcher.submit)
    qtbot.addWidget(tab)
    ram, disk = tab.rows["conversation_cache_mib"], tab.rows["conversation_cache_disk_mib"]
    assert ram.editor.isEnabled() and not disk.editor.isEnabled(), "ram mode: no disk budget"
    tab.set_text("conversation_cache_storage", "disk")
    assert not ram.editor.isEnabled() and "not used in disk mode" in ram.caption.text()
    assert disk.editor.isEnabled() and "not used" not in disk.caption.text()
    tab.set_text("conversation_cache_storage", "tiered")
    assert ram.editor.isEnabled() and disk.editor.isEnabled()
    dispatcher.close()


def test_risky_values_are_accepted_with_a_warning(qtbot, tmp_path):
    from desktop.client import Dispatcher
    from desktop.settings_tab import SettingsTab

    dispatcher = Dispatcher()
    store = SettingsStore(tmp_path / "s.json", environ={})
    tab = SettingsTab(store, AutoSaver(store, dispatcher.submit), dispatcher.submit)
    qtbot.addWidget(tab)
    qtbot.waitUntil(lambda: tab.host_total is not None, timeout=5000)
    tab.set_text("port", "80")
    assert store.value("port") == 80 and "administrator rights" in tab.rows["port"].caption.text()
    tab.set_text("port", "0")
    assert "cannot know it" in tab.rows["port"].caption.text()
    tab.set_text("port", "8181")
    assert "administrator" not in tab.rows["port"].caption.text()
    tab.set_text("conversation_cache_mib", "16 TiB")  # the most it takes, more than any machine this runs on
    row = tab.rows["conversation_cache_mib"]
    assert "more than this computer's RAM" in row.caption.text()
    tab.set_text("conversation_cache_mib", "4 GB")
    assert store.value("conversation_cache_mib") == 4096 and "GB read as GiB" in row.caption.text()
    assert "more than" not in row.caption.text() or tab.host_total < 4 << 30
    dispatcher.close()


def test_the_ram_budget_says_what_a_moe_models_expert_arena_leaves(qtbot, tmp_path):
    """Beside the RAM budget: the running engine's expert arena, and when the arena leaves less than the budget
    above the floor, that RAM parks will be refused and disk storage keeps parking."""
    from desktop.client import Dispatcher
    from desktop.settings_tab import SettingsTab

    dispatcher = Dispatcher()
    store = SettingsStore(tmp_path / "s.json", environ={})
    tab = SettingsTab(store, AutoSaver(store, dispatcher.submit), dispatcher.submit)
    qtbot.addWidget(tab)
    qtbot.waitUntil(lambda: tab.host_total is not None, timeout=5000)
    row = tab.rows["conversation_cache_mib"]
    assert "expert arena" not in row.caption.text(), "a dense model (or none running) has no arena"
    tab.set_expert_arena(100 << 20)
    assert "expert arena holds 100.0 MiB of RAM" in row.caption.text() and "refused" not in row.caption.text()
    assert "color: #666" in row.caption.styleSheet()
    tab.set_expert_arena(tab.host_total - (2 << 30))  # 1 GiB left above the default 1 GiB floor, 4 GiB budget
    assert "RAM parks will be refused — disk storage keeps parking" in row.caption.text()
    assert "color: #b26a00" in row.caption.styleSheet(), "said as a warning"
    tab.set_text("conversation_cache_mib", "512")
    assert "refused" not in row.caption.text(), "a budget that fits beside the arena"
    tab.set_text("conversation_cache_mib", "4096")
    tab.set_text("conversation_cache_storage", "disk")
    assert "expert arena" in row.caption.text() and "refused" not in row.caption.text()
    tab.set_expert_arena(0)
    assert "expert arena" not in row.caption.text()
    dispatcher.close()


def _tab(qtbot, store, **kwargs):
    from desktop.client import Dispatcher
    from desktop.settings_tab import SettingsTab

    dispatcher = Dispatcher()
    saver = AutoSaver(store, dispatcher.submit, delay_ms=50)
    tab = SettingsTab(store, saver, dispatcher.submit, **kwargs)
    qtbot.addWidget(tab)
    return tab, saver, dispatcher


def test_yes_no_settings_are_checkboxes_stored_and_applied_like_the_others(qtbot, tmp_path):
    """Every kind="bool" setting is a checkbox (never a text field holding "False"); a click stores, saves and
    puts the flag on the command line; a value from the file shows checked; Reset unchecks."""
    from PySide6.QtCore import Qt
    from PySide6.QtWidgets import QCheckBox

    from engine.config import all_settings

    path = tmp_path / "s.json"
    path.write_text(json.dumps({"schema": 1, "engine": {"no_cuda_graphs": True}}))
    store = SettingsStore(path, environ={})
    store.load()
    tab, saver, dispatcher = _tab(qtbot, store)
    tab.show()
    yes_no = [name for name, spec, _ in all_settings() if spec.kind == "bool"]
    assert {"no_cuda_graphs", "deterministic", "allow_special_in_content"} <= set(yes_no)
    for name in yes_no:
        if name in tab.rows:
            editor = tab.rows[name].editor
            assert isinstance(editor, QCheckBox), (name, type(editor).__name__)
            assert editor.isChecked() is store.value(name), name
    assert "allow_special_in_content" in tab.rows and "no_cuda_graphs" in tab.rows, "changed: shown on any machine"
    assert tab.rows["no_cuda_graphs"].editor.isChecked(), "true in the file: checked"

    box = tab.rows["allow_special_in_content"].editor
    qtbot.mouseClick(box, Qt.MouseButton.LeftButton)
    assert box.isChecked() and store.value("allow_special_in_content") is True
    assert store.source("allow_special_in_content") is Source.FILE
    assert "--allow-special-in-content true" in tab.command.text()
    assert EngineConfig.from_mapping({"allow-special-in-content": "true"}).allow_special_in_content is True
    with qtbot.waitSignal(saver.saved, timeout=3000):
        pass
    assert json.loads(path.read_text())["engine"] == {"allow_special_in_content": True, "no_cuda_graphs": True}
    tab.reset("allow_special_in_content")
    assert not box.isChecked() and store.source("allow_special_in_content") is Source.DEFAULT
    tab.set_text("no_cuda_graphs", "false")  # as set_text types any other setting
    assert not tab.rows["no_cuda_graphs"].editor.isChecked() and store.value("no_cuda_graphs") is False
    dispatcher.close()


@pytest.mark.skipif(sys.platform == "win32", reason="fakes Linux's driver files and a nvidia-smi without .exe")
def test_gpu_only_settings_are_hidden_without_an_nvidia_gpu(qtbot, tmp_path):
    """No NVIDIA GPU: the settings that only act on CUDA are not shown (one line says so), unless one was changed
    from its default (then it is in effect and stays shown). The check reads the driver's files, never torch."""
    import stat

    from desktop.gpu import GPU_ONLY_SETTINGS, nvidia_gpu_present
    from desktop.settings_tab import SettingsTab

    # The check itself, on real files: the Linux driver's /proc entry, WSL's library, nvidia-smi on PATH.
    empty = tmp_path / "root"
    (empty / "bin").mkdir(parents=True)
    assert not nvidia_gpu_present(platform="linux", root=str(empty), path=str(empty / "bin"))
    assert not nvidia_gpu_present(platform="darwin", root=str(empty), path=str(empty / "bin"))
    driver = tmp_path / "driver"
    (driver / "proc/driver/nvidia").mkdir(parents=True)
    (driver / "proc/driver/nvidia/version").write_text("NVRM version: 550.54\n")
    assert nvidia_gpu_present(platform="linux", root=str(driver), path=str(empty / "bin"))
    smi = empty / "bin" / "nvidia-smi"
    smi.write_text("#!/bin/sh\n")
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    assert nvidia_gpu_present(platform="linux", root=str(empty), path=str(empty / "bin"))
    windows = tmp_path / "windows"
    (windows / "System32").mkdir(parents=True)
    (windows / "System32" / "nvml.dll").write_bytes(b"MZ")
    assert nvidia_gpu_present(platform="win32", root=str(windows), path=str(tmp_path / "nothing"))

    assert set(GPU_ONLY_SETTINGS) == {"no_cuda_graphs", "deterministic", "gpu_weights", "devices", "layer_split"}
    store = SettingsStore(tmp_path / "s.json", environ={})
    store.set("gpu_weights", "int4")  # changed: in effect, so shown even here
    tab, _saver, dispatcher = _tab(qtbot, store, gpu=False)
    assert [n for n in GPU_ONLY_SETTINGS if n in tab.rows] == ["gpu_weights"]
    assert "cpu_weights" in tab.rows and "moe_experts" in tab.rows and "threads" in tab.rows
    assert "No NVIDIA GPU" in tab.gpu_note.text() and "No CUDA graphs" in tab.gpu_note.text()
    assert "Weights on the GPU" not in tab.gpu_note.text(), "shown: not listed as hidden"
    assert "--gpu-weights int4" in tab.command.text()
    dispatcher.close()

    tab, _saver, dispatcher = _tab(qtbot, SettingsStore(tmp_path / "t.json", environ={}), gpu=True)
    assert all(n in tab.rows for n in GPU_ONLY_SETTINGS) and tab.gpu_note.isHidden()
    dispatcher.close()
    # Left to itself the tab asks this machine.
    tab, _saver, dispatcher = _tab(qtbot, SettingsStore(tmp_path / "u.json", environ={}))
    assert ("no_cuda_graphs" in tab.rows) is nvidia_gpu_present() is tab.gpu
    assert isinstance(tab, SettingsTab)
    dispatcher.close()


def test_captions_speak_only_when_they_say_something_and_zero_is_said_in_words(qtbot, tmp_path):
    """No caption under an untouched field ("applies after a restart · default" forty times): how a group's
    settings apply is said once per group and in each field's tooltip; a changed value, an error or a warning
    is said under its field, and so is what 0 means where it means something."""
    from PySide6.QtWidgets import QGroupBox, QLabel

    from desktop.settings_words import ZERO_WORDS

    store = SettingsStore(tmp_path / "s.json", environ={})
    tab, _saver, dispatcher = _tab(qtbot, store, gpu=True)
    tab.resize(900, 700)
    tab.show()
    qtbot.waitUntil(lambda: tab.host_total is not None, timeout=5000)
    spoken = {name: row.caption.text() for name, row in tab.rows.items() if row.caption.text()}
    zero_now = {name for name in ZERO_WORDS if name in tab.rows and store.value(name) == 0}
    assert spoken.pop("conversation_cache_disk_mib") == "not used in ram mode"
    assert set(spoken) == zero_now, "only 0's meaning is said under untouched fields"
    for name, text in spoken.items():
        assert text == ZERO_WORDS[name] and "restart" not in text, (name, text)
        assert tab.rows[name].caption.isVisibleTo(tab)
    assert tab.rows["ctx_size"].caption.isHidden(), "an empty caption takes no room"
    everything = [label.text() for label in tab.findChildren(QLabel)]
    assert sum("after a restart" in t for t in everything) <= len(tab.findChildren(QGroupBox)), "once per group"
    assert "after a restart" in tab.rows["ctx_size"].editor.toolTip()
    assert "live" in tab.rows["conversation_cache_mib"].editor.toolTip()

    # 0 in words, where the setting gives 0 a meaning.
    assert tab.rows["threads"].caption.text() == ZERO_WORDS["threads"] and "automatic" in ZERO_WORDS["threads"]
    tab.set_text("conversation_cache_similarity", "0.5")
    assert tab.rows["conversation_cache_similarity"].caption.text().startswith("changed from the default (0)")
    tab.set_text("conversation_cache_similarity", "0")
    assert tab.rows["conversation_cache_similarity"].caption.text() == ZERO_WORDS["conversation_cache_similarity"]
    tab.set_text("conversation_cache_storage", "tiered")
    tab.set_text("conversation_cache_disk_mib", "0")
    disk = tab.rows["conversation_cache_disk_mib"].caption.text()
    assert "no disk parking" in disk and "changed from the default (16 GiB)" in disk, disk
    # A disk budget past the folder's free space is warned of where disk storage uses it, and only there.
    tab.set_text("conversation_cache_disk_mib", str(1 << 30))
    caption = tab.rows["conversation_cache_disk_mib"].caption
    qtbot.waitUntil(lambda: "more than the free space on disk" in caption.text(), timeout=5000)
    tab.set_text("conversation_cache_storage", "ram")
    assert caption.text().startswith("not used in ram mode") and "free space" not in caption.text(), caption.text()
    tab.set_text("conversation_cache_storage", "tiered")
    tab.set_text("conversation_cache_disk_mib", "0")
    tab.set_text("conversation_cache_mib", "0")
    assert "no RAM parking" in tab.rows["conversation_cache_mib"].caption.text()
    # A changed value says what it replaced and when it applies.
    tab.set_text("port", "8181")
    assert tab.rows["port"].caption.text() == "changed from the default (8080) · applies after a restart"
    tab.reset("port")
    assert tab.rows["port"].caption.text() == "" and tab.rows["port"].caption.isHidden()
    # Every setting that takes 0 and does not forbid it says what 0 means (the port warns instead).
    from engine.config import all_settings

    takes_zero = {n for n, spec, _ in all_settings() if spec.kind in ("int", "float") and spec.minimum == 0}
    assert takes_zero - {"port"} == set(ZERO_WORDS), takes_zero ^ set(ZERO_WORDS)
    dispatcher.close()


def test_command_line_reads_a_store_url_with_a_password_from_a_variable():
    with_password = EngineConfig(conversation_cache_remote="redis://team:hunter2@127.0.0.1:6379/0")
    text = command_line(with_password, shell="posix")
    assert "hunter2" not in text and '--conversation-cache-remote "$STRATA_CONVERSATION_CACHE_REMOTE"' in text
    assert secret_variables(with_password) == ["STRATA_CONVERSATION_CACHE_REMOTE"]
    without = EngineConfig(conversation_cache_remote="redis://127.0.0.1:6379/0")
    assert "--conversation-cache-remote redis://127.0.0.1:6379/0" in command_line(without, shell="posix")


def test_the_settings_tab_chooses_the_speculation_method_and_its_draft_length(qtbot, tmp_path):
    from PySide6.QtWidgets import QComboBox

    from desktop.client import Dispatcher
    from desktop.settings_tab import SettingsTab

    dispatcher = Dispatcher()
    store = SettingsStore(tmp_path / "s.json", environ={})
    tab = SettingsTab(store, AutoSaver(store, dispatcher.submit, delay_ms=50), dispatcher.submit)
    qtbot.addWidget(tab)
    method = tab.rows["spec"].editor
    assert isinstance(method, QComboBox)
    assert [method.itemData(i) for i in range(method.count())] == ["off", "prompt-lookup", "draft", "mtp"]
    assert method.currentData() == "off" and method.itemText(1).startswith("prompt lookup — drafts from")
    assert method.itemText(3).startswith("next-token layer — the model's own MTP layer drafts")
    assert method.itemText(2).startswith("draft model — a smaller model")
    tab.set_text("spec", "prompt-lookup")
    tab.set_text("spec_draft_max", "16")
    assert store.value("spec") == "prompt-lookup" and store.value("spec_draft_max") == 16
    assert tab.rows["spec"].caption.text() == "changed from the default (off) · applies after a restart"
    assert "--spec prompt-lookup" in tab.command.text() and "--spec-draft-max 16" in tab.command.text()
    tab.set_text("spec_draft_max", "0")
    assert "Most draft tokens" in tab.rows["spec_draft_max"].error and store.value("spec_draft_max") == 16
