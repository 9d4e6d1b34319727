"""What the Settings tab says beside a value: budgets the storage mode does not use greyed, risky values accepted
with a warning, the RAM budget against a MoE model's expert arena, and captions that speak only when they say
something."""

from __future__ import annotations

import os

os.environ["QT_QPA_PLATFORM"] = "offscreen"

from desktop.settings import AutoSaver, SettingsStore
from tests.test_desktop_settings import make_tab


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


def test_captions_speak_only_when_they_say_something_and_zero_is_said_in_words(qtbot, tmp_path):
    """No caption under an untouched field ("applies after a restart · default" forty times): how a group's
    settings apply is said once per group and in each field's tooltip; a changed value, an error or a warning
    is said under its field, and so is what 0 means where it means something."""
    from PySide6.QtWidgets import QGroupBox, QLabel

    from desktop.settings_words import ZERO_WORDS

    store = SettingsStore(tmp_path / "s.json", environ={})
    tab, _saver, dispatcher = make_tab(qtbot, store, gpu=True)
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
