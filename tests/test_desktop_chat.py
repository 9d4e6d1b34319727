"""The Chat tab against the real engine on the bundled model, started by the app: answers stream in piece by
piece, a second turn and a returning conversation come back cached, Stop cancels. One engine serves the tests
in order (one slot, so a second conversation parks the first).
"""

from __future__ import annotations

import os

os.environ["QT_QPA_PLATFORM"] = "offscreen"

import time

import pytest
from PySide6.QtCore import QEventLoop, Qt
from PySide6.QtWidgets import QApplication

from desktop.chat_stream import TurnStats
from desktop.chat_tab import ChatTab, Conversation, render
from desktop.engine_process import EngineState
from desktop.main_window import MainWindow
from desktop.settings import Paths
from engine.figures import CacheFigures

pytestmark = pytest.mark.timeout(240)
LOAD_TIMEOUT_S = 120
TURN_TIMEOUT_MS = 60_000
# Long enough that a prefix reused or not is plain in the figures; short answers keep the test quick.
QUESTION_A = "Tell me something about apples, the fruit that grows on trees in orchards. " * 12
QUESTION_B = "Tell me something about rivers, the water that flows to the sea under bridges. " * 12


def pump_until(cond, timeout_s: float) -> bool:
    app = QApplication.instance()
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        app.processEvents(QEventLoop.ProcessEventsFlag.AllEvents, 50)
        if cond():
            return True
        time.sleep(0.01)
    return False


@pytest.fixture(scope="module")
def app_window(qapp, tmp_path_factory):
    base = tmp_path_factory.mktemp("desktop-chat")
    w = MainWindow(Paths(base / "cfg", base / "state"), use_tray=False, environ={})
    w.store.set("port", 0)
    w.store.set("parallel", 1)
    w.store.set("max_tokens_policy", "refuse")  # a max_tokens past the context is refused (the default caps it)
    w.store.set("conversation_cache_dir", str(base / "parked"))
    w.show()
    w.start()
    assert pump_until(lambda: w.engine.state is EngineState.READY, LOAD_TIMEOUT_S), "\n".join(w.engine.lines)
    w.tabs.setCurrentWidget(w.chat)
    yield w
    w.shutdown_now()


def say(qtbot, tab: ChatTab, text: str, max_tokens: int = 6) -> TurnStats:
    """Type `text`, press Enter, wait for the answer to finish; its figures."""
    tab.max_tokens.setValue(max_tokens)
    tab.input.setText(text)
    with qtbot.waitSignal(tab.turn_finished, timeout=TURN_TIMEOUT_MS) as done:
        qtbot.keyClick(tab.input, Qt.Key.Key_Return)
    return done.args[0]


def test_chat_is_off_with_a_reason_until_the_engine_is_ready(qtbot):
    tab = ChatTab()
    qtbot.addWidget(tab)
    assert not tab.send_button.isEnabled() and not tab.input.isEnabled() and not tab.stop_button.isEnabled()
    assert "start it" in tab.status.text()
    tab.input.setText("hello")
    tab.send()  # ignored, not sent anywhere
    assert tab.current.messages == [] and tab.stream is None
    tab.set_engine(EngineState.READY, "http://127.0.0.1:1", None)
    assert tab.send_button.isEnabled() and "start it" not in tab.status.text()


def test_an_engine_that_cannot_be_reached_is_said_and_the_message_is_kept(qtbot):
    tab = ChatTab()
    qtbot.addWidget(tab)
    tab.set_engine(EngineState.READY, "http://127.0.0.1:1", None)  # nothing listens on port 1
    tab.input.setText("hello there")
    with qtbot.waitSignal(tab.turn_failed, timeout=20000) as failed:
        tab.send_button.click()
    assert failed.args[0].startswith("Cannot reach the engine") and tab.status.text() == failed.args[0]
    assert tab.current.messages == [] and tab.input.text() == "hello there", "ready to be sent again"
    assert tab.send_button.isEnabled() and not tab.stop_button.isEnabled()


def test_transcript_escapes_markup_and_names_the_conversation():
    c = Conversation([{"role": "user", "content": "<b>why</b> are apples red and pears green, asks Ann"},
                      {"role": "assistant", "content": "a & b"}],
                     {1: TurnStats(100, 90, 5, 0.25, 1.25)})
    page = render(c)
    assert "&lt;b&gt;why" in page and "a &amp; b" in page
    assert "prompt 100 tokens · cached 90 (90 %) · first token 0.25 s · 4.0 tokens/s" in page
    assert c.title == "<b>why</b> are apples red and pears …"
    assert Conversation().title == "New conversation"


def test_answer_streams_in_pieces_and_the_second_turn_is_cached(qtbot, app_window):
    tab = app_window.chat
    shown: list[int] = []  # the transcript's length each time a piece arrived
    tab.piece_shown.connect(lambda _p: shown.append(len(tab.view.toPlainText())))
    first = say(qtbot, tab, QUESTION_A, max_tokens=8)
    answer = tab.current.messages[-1]["content"]
    assert len(shown) >= 2, "the answer arrived in more than one piece"
    assert shown == sorted(set(shown)), "each piece grew the transcript"
    assert answer and answer.strip() in tab.view.toPlainText()
    assert first.prompt_tokens > 100 and first.completion_tokens >= 1 and first.ttft_s is not None
    assert tab.list.item(0).text().startswith("Tell me something about apples")

    second = say(qtbot, tab, "And pears?")
    assert second.cached_tokens > 0
    assert second.cached_tokens >= first.prompt_tokens // 2, "the first turn's prompt was reused"
    assert f"cached {second.cached_tokens:,}" in tab.view.toPlainText()


def test_a_returning_conversation_is_restored_and_shown_in_the_monitor(qtbot, app_window):
    w = app_window
    tab = w.chat
    a = tab.current
    tab.new_button.click()
    b = tab.current
    assert b is not a and tab.list.count() == 2
    say(qtbot, tab, QUESTION_B)  # takes the only slot: A is parked
    shown = tab.view.toPlainText()
    # Headers are lines of their own: the answer itself may say "You" ("Your thoughts?").
    assert shown.splitlines().count("You") == 1 and "apples" not in shown, "B's transcript alone is shown"
    tab.pick(0)
    assert tab.current is a and "apples" in tab.view.toPlainText()
    previous = a.stats[max(a.stats)]
    back = say(qtbot, tab, "And plums?")
    # Most of A's prompt (all before this turn's question) came back from the cache, not recomputed.
    assert back.cached_tokens >= (previous.prompt_tokens or 0) * 0.8, (back, previous)
    assert back.cached_tokens > back.prompt_tokens // 2

    def cache() -> CacheFigures:
        return w.metrics.conversation_cache if w.metrics is not None else CacheFigures(enabled=False, storage="")

    w.tabs.setCurrentWidget(w.monitor)
    w.poller.poll()
    assert pump_until(lambda: cache().parks >= 1 and cache().restores >= 1, 20)
    assert pump_until(lambda: w.monitor.model.rowCount() >= 1, 20), "the parked conversation is listed"
    w.tabs.setCurrentWidget(tab)


def test_a_refused_request_says_why_in_plain_words(qtbot, app_window):
    tab = app_window.chat
    tab.new_button.click()
    tab.max_tokens.setValue(32768)  # more than the slot's context holds: the engine answers 400 with the numbers
    tab.input.setText("Hello")
    with qtbot.waitSignal(tab.turn_failed, timeout=TURN_TIMEOUT_MS) as failed:
        tab.send_button.click()
    assert failed.args[0].startswith("The engine refused the request:") and "context" in failed.args[0]
    assert tab.input.text() == "Hello" and tab.current.messages == []


def test_stop_cancels_the_answer_and_the_engine_serves_the_next_turn(qtbot, app_window):
    tab = app_window.chat
    tab.new_button.click()
    tab.max_tokens.setValue(1500)
    tab.input.setText("Count from 1 to 1000, one number per line, and say nothing else.")
    with qtbot.waitSignal(tab.piece_shown, timeout=TURN_TIMEOUT_MS):
        tab.send_button.click()
    stream = tab.stream
    assert stream is not None and tab.stop_button.isEnabled() and not tab.send_button.isEnabled()
    finished: list[object] = []
    tab.turn_finished.connect(finished.append)
    with qtbot.waitSignal(tab.turn_stopped, timeout=5000) as stopped:
        tab.stop_button.click()
    assert stopped.args[0].stopped and "stopped" in tab.view.toPlainText()
    assert tab.send_button.isEnabled() and not tab.stop_button.isEnabled()
    assert stream.join(30), "the worker dropped the connection"
    assert not stream.reached_end, "the stream was cut before the engine finished it"
    partial = tab.current.messages[-1]["content"]
    assert partial, "what came before Stop stays"
    pump_until(lambda: False, 0.3)  # pieces already queued when Stop was pressed are dropped
    assert tab.current.messages[-1]["content"] == partial and not finished
    # The engine freed the slot: the next turn is answered.
    after = say(qtbot, tab, "Thanks, that is enough.")
    assert after.completion_tokens >= 1


def test_the_engine_lists_the_chats_requests_as_the_strata_desktop_chat(qtbot, app_window):
    """The Chat tab's requests name their client (X-Strata-Client), not the HTTP library that sends them."""
    import httpx

    w = app_window
    tab = w.chat
    tab.new_button.click()
    say(qtbot, tab, "Name a colour.")
    body = httpx.get(w.engine.url + "/cache/requests?limit=50", timeout=10, trust_env=False).json()
    clients = {row["client"] for row in body["requests"]}
    assert clients == {"Strata Desktop chat"}, clients
