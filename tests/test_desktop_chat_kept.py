"""The Chat tab's conversations outlive the app: kept in a JSON file in the data folder, listed again on the next
launch and continued there, the engine restoring the conversation it parked on disk instead of prefilling it.
A damaged file is refused with a reason and the chats start empty; a write cut short leaves the old file whole.
"""

from __future__ import annotations

import os

os.environ["QT_QPA_PLATFORM"] = "offscreen"

import json

import pytest

from desktop.chat_store import ChatKeeper
from desktop.chat_tab import Conversation
from desktop.engine_process import EngineState
from desktop.main_window import MainWindow
from desktop.settings import Paths
from tests.test_desktop_chat import LOAD_TIMEOUT_S, QUESTION_A, pump_until, say

pytestmark = pytest.mark.timeout(300)


def launch(paths: Paths, parked: str) -> MainWindow:
    w = MainWindow(paths, use_tray=False, environ={})
    w.store.set("port", 0)
    w.store.set("parallel", 1)
    w.store.set("conversation_cache_storage", "disk")  # parked in files: they outlive the engine
    w.store.set("conversation_cache_dir", parked)
    return w


def ready(w: MainWindow) -> None:
    w.show()
    w.start()
    assert pump_until(lambda: w.engine.state is EngineState.READY, LOAD_TIMEOUT_S), "\n".join(w.engine.lines)
    w.tabs.setCurrentWidget(w.chat)


def test_a_chat_is_listed_after_a_relaunch_and_its_next_turn_is_restored_from_disk(qtbot, qapp, tmp_path):
    paths = Paths(tmp_path / "cfg", tmp_path / "state", data_dir=tmp_path / "data")
    parked = str(tmp_path / "parked")
    first = launch(paths, parked)
    ready(first)
    asked = say(qtbot, first.chat, QUESTION_A, max_tokens=8)
    answer = first.chat.current.messages[-1]["content"]
    # Written after the turn, not only at quit: an app that is killed keeps it too.
    assert pump_until(lambda: paths.chats_file.exists() and "apples" in paths.chats_file.read_text(), 10)
    with qtbot.waitSignal(first.quit_finished, timeout=60_000):
        first.quit()  # a clean stop: the engine parks its slot's conversation on disk

    second = launch(paths, parked)
    try:
        tab = second.chat
        assert tab.list.count() == 1 and tab.list.item(0).text().startswith("Tell me something about apples")
        assert tab.current.messages == [{"role": "user", "content": QUESTION_A.strip()},
                                         {"role": "assistant", "content": answer}]
        assert answer.strip() in tab.view.toPlainText() and asked.summary() in tab.view.toPlainText()
        assert tab.last_stats() == asked, "the turn's figures come back with it"
        ready(second)
        again = say(qtbot, tab, "And pears?")
        # All of the first turn (question and answer) came from the conversation parked on disk.
        assert again.cached_tokens >= asked.prompt_tokens, (again, asked)
        assert again.cached_tokens > again.prompt_tokens * 0.8, again
        assert pump_until(lambda: "And pears?" in paths.chats_file.read_text(), 10)
    finally:
        second.shutdown_now()


def test_a_damaged_transcripts_file_is_refused_with_a_reason_and_kept_aside(qtbot, tmp_path):
    paths = Paths(tmp_path / "cfg", tmp_path / "state", data_dir=tmp_path / "data")
    paths.chats_file.parent.mkdir(parents=True)
    paths.chats_file.write_text('{"schema": 1, "conversations": [{"messages": [{"role": "user", "cont')
    w = MainWindow(paths, use_tray=False, environ={})
    qtbot.addWidget(w)
    try:
        assert w.chat.list.count() == 1 and w.chat.current.messages == [], "an empty chat, no crash"
        lines = "\n".join(w.logs.view.toPlainText().splitlines())
        assert "chat transcripts" in lines and "damaged" in lines, lines
        assert "damaged" in w.notice.text() and not w.notice.isHidden()
        aside = list(paths.chats_file.parent.glob("chats.json.damaged-*"))
        assert len(aside) == 1 and '"cont' in aside[0].read_text(), "the user's words are not thrown away"
        assert not paths.chats_file.exists()
    finally:
        w.shutdown_now()


def test_a_write_cut_short_leaves_the_old_transcripts_whole(qtbot, tmp_path, monkeypatch):
    path = tmp_path / "chats.json"
    keeper = ChatKeeper(path, lambda work, done: done(work()))
    old = [Conversation([{"role": "user", "content": "kept"}])]
    keeper.flush(old)
    before = path.read_bytes()

    def crash(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", crash)
    failures: list[str] = []
    keeper.failed.connect(failures.append)
    keeper.flush([Conversation([{"role": "user", "content": "new " * 1000}])])
    assert failures and "No space left" in failures[0]
    assert path.read_bytes() == before and json.loads(before)["conversations"][0]["messages"][0]["content"] == "kept"
    assert [p.name for p in tmp_path.iterdir()] == ["chats.json"], "no temp file left behind"
