"""The Settings tab: the command line shown whole and copied without the key, validation as you type and autosave,
an unwritable folder, start at login, the wheel over a combo box, half-typed values, settings in words, yes/no
settings as checkboxes, GPU-only settings, the speculation method (the file and the captions: the two modules
beside this one)."""

from __future__ import annotations

import json
import os
import sys

os.environ["QT_QPA_PLATFORM"] = "offscreen"

import pytest

from desktop.settings import (
    AutoSaver,
    SettingsStore,
    Source,
    command_line,
)
from engine.config import EngineConfig


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


def test_a_start_at_login_change_that_fails_halfway_shows_the_entries_left_on_disk(qtbot, tmp_path, monkeypatch):
    """Windows: the new shortcut is written, then the old .cmd entry stays held by another program. The change
    fails with the error's words, and the box shows what is on disk (on: an entry starts the app), not "off"."""
    from desktop import files
    from desktop.autostart import WINDOWS_FALLBACK, Autostart
    from desktop.client import Dispatcher
    from desktop.settings_tab import SettingsTab
    from tests.test_autostart import EXE, FakeShell, Refusing

    monkeypatch.setattr(files, "SHARING_VIOLATIONS", True)
    monkeypatch.setattr(files, "SHARING_RETRIES", 2)
    shell = FakeShell()
    entry = Autostart(platform="win32", folder=tmp_path, command=[EXE], shortcut_writer=shell.write,
                      shortcut_reader=shell.read)
    old = tmp_path / WINDOWS_FALLBACK
    old.write_text("@echo off\r\n", encoding="utf-8")
    monkeypatch.setattr(os, "unlink", Refusing(os.unlink, old, times=1000))
    dispatcher = Dispatcher()
    store = SettingsStore(tmp_path / "s.json", environ={})
    tab = SettingsTab(store, AutoSaver(store, dispatcher.submit), dispatcher.submit, entry)
    qtbot.addWidget(tab)
    qtbot.waitUntil(tab.login_box.isEnabled, timeout=15_000)
    tab.login_box.blockSignals(True)
    tab.login_box.setChecked(False)  # as if the .cmd were not read as an entry: the user turns it on
    tab.login_box.blockSignals(False)
    tab.login_box.setChecked(True)
    qtbot.waitUntil(lambda: "Could not change start at login" in tab.result.text(), timeout=15_000)
    assert "could not be changed through 2 tries" in tab.result.text()
    qtbot.waitUntil(tab.login_box.isChecked, timeout=15_000)
    assert entry.is_enabled() and old.exists()
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


def make_tab(qtbot, store, **kwargs):
    """A Settings tab over `store`, its autosaver (50 ms) and dispatcher."""
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
    tab, saver, dispatcher = make_tab(qtbot, store)
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

    assert set(GPU_ONLY_SETTINGS) == {"no_cuda_graphs", "deterministic", "gpu_weights", "devices", "layer_split",
                                      "device_draft"}
    store = SettingsStore(tmp_path / "s.json", environ={})
    store.set("gpu_weights", "int4")  # changed: in effect, so shown even here
    tab, _saver, dispatcher = make_tab(qtbot, store, gpu=False)
    assert [n for n in GPU_ONLY_SETTINGS if n in tab.rows] == ["gpu_weights"]
    assert "cpu_weights" in tab.rows and "moe_experts" in tab.rows and "threads" in tab.rows
    assert "No NVIDIA GPU" in tab.gpu_note.text() and "No CUDA graphs" in tab.gpu_note.text()
    assert "Weights on the GPU" not in tab.gpu_note.text(), "shown: not listed as hidden"
    assert "--gpu-weights int4" in tab.command.text()
    dispatcher.close()

    tab, _saver, dispatcher = make_tab(qtbot, SettingsStore(tmp_path / "t.json", environ={}), gpu=True)
    assert all(n in tab.rows for n in GPU_ONLY_SETTINGS) and tab.gpu_note.isHidden()
    dispatcher.close()
    # Left to itself the tab asks this machine.
    tab, _saver, dispatcher = make_tab(qtbot, SettingsStore(tmp_path / "u.json", environ={}))
    assert ("no_cuda_graphs" in tab.rows) is nvidia_gpu_present() is tab.gpu
    assert isinstance(tab, SettingsTab)
    dispatcher.close()


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
