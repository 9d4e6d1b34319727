"""The Chat tab with a thinking model: its reasoning streams into the transcript in grey italics above the answer,
is kept with the turn (and in the chats file), and goes back to the engine with the next turn as the assistant
message's `reasoning_content`, where the template sees it. A real engine serves a tiny model whose answer is
scripted (tests/test_api_tools.py): a thought whose close marker is split over two tokens, then the answer. Another
serves a harmony (gpt-oss) model whose reasoning follows a preamble of its answer (tests/harmony_fixtures.py)."""

from __future__ import annotations

import os

os.environ["QT_QPA_PLATFORM"] = "offscreen"

import json

import pytest
from PySide6.QtGui import QTextCursor, QTextDocument

from desktop.chat_store import from_json, to_json
from desktop.chat_stream import ChatStream
from desktop.chat_tab import THOUGHT_STYLE, ChatTab, render
from desktop.engine_process import EngineState
from tests.engine_process import engine_process
from tests.harmony_fixtures import write_harmony_model
from tests.test_api_tools import write_scripted_model
from tests.test_desktop_chat import say
from tests.test_thoughts import R1_LIKE, THINK

pytestmark = pytest.mark.timeout(240)
PIECES = ["Apples are fruit. ", "Say so.\n</th", "ink>\n\n", "Apples grow on trees."]
THOUGHT, ANSWER = "Apples are fruit. Say so.", "Apples grow on trees."


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    model = write_scripted_model(tmp_path_factory.mktemp("thinking-chat"), PIECES, THINK, R1_LIKE)
    with engine_process("--model", model, "--ctx-size", "512") as engine:
        yield engine.base_url


def test_the_thought_streams_apart_from_the_answer_and_goes_back_with_the_turn(qtbot, base_url):
    tab = ChatTab()
    qtbot.addWidget(tab)
    tab.set_engine(EngineState.READY, base_url, None)
    tab.new_conversation()
    shown: list[tuple[str, bool]] = []  # each streamed piece, and whether the transcript's last character is italic

    def streamed(piece: str) -> None:
        end = QTextCursor(tab.view.document())
        end.movePosition(QTextCursor.MoveOperation.End)
        shown.append((piece, end.charFormat().fontItalic()))  # the format of the character before the cursor

    tab.piece_shown.connect(streamed)
    stats = say(qtbot, tab, "Tell me about apples.", max_tokens=8)
    message = tab.current.messages[-1]
    assert (message["reasoning_content"], message["content"]) == (THOUGHT, ANSWER)
    assert len(shown) >= 3, "the thought and the answer streamed in pieces"
    assert any(piece in THOUGHT for piece, _ in shown) and any(piece in ANSWER for piece, _ in shown), shown
    assert all(italic for piece, italic in shown if piece in THOUGHT), shown  # drawn as the thought, while streaming
    assert not any(italic for piece, italic in shown if piece in ANSWER), shown
    assert stats.completion_tokens == len(PIECES) + 1 and stats.ttft_s is not None  # and the end of the turn
    text = tab.view.toPlainText()
    assert text.index(THOUGHT) < text.index(ANSWER) and "</think>" not in text
    cursor = tab.view.textCursor()  # the thought is drawn in italics, the answer not
    cursor.setPosition(text.index(THOUGHT) + 1)
    assert cursor.charFormat().fontItalic()
    cursor.setPosition(text.index(ANSWER) + 1)
    assert not cursor.charFormat().fontItalic()
    assert THOUGHT_STYLE in render(tab.current)

    # Kept in the chats file and read back the same; the next turn sends it back as the template's input.
    assert from_json(to_json(tab.conversations))[0].messages == tab.current.messages
    tab.input.setText("And pears?")
    body = ChatStream(base_url, None, [*tab.current.messages, {"role": "user", "content": "And pears?"}],
                      max_tokens=8).body
    assert body["messages"][1] == {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT}
    second = say(qtbot, tab, "And pears?", max_tokens=8)
    # The first turn's prompt and its answer, thought included, came back from the cache as generated.
    assert second.cached_tokens is not None and stats.prompt_tokens is not None
    assert second.cached_tokens >= stats.prompt_tokens + 2, (second.cached_tokens, stats.prompt_tokens)
    assert json.loads(to_json(tab.conversations))["conversations"][0]["messages"][1]["reasoning_content"] == THOUGHT


# gpt-oss's order: a commentary preamble (answer text), then more analysis (reasoning), then the final answer.
HARMONY_PIECES = ("<|channel|>commentary<|message|>Preamble. ",
                  "<|end|><|start|>assistant<|channel|>analysis<|message|>T1 ", "T2 ",
                  "<|end|><|start|>assistant<|channel|>final<|message|>Done.")


@pytest.fixture(scope="module")
def harmony_url(tmp_path_factory):
    model = write_harmony_model(tmp_path_factory.mktemp("harmony-chat"), HARMONY_PIECES, "<|return|>")
    with engine_process("--model", model, "--ctx-size", "1024") as engine:
        yield engine.base_url


def test_reasoning_after_a_preamble_of_the_answer_streams_into_the_thought_above_it(qtbot, harmony_url):
    tab = ChatTab()
    qtbot.addWidget(tab)
    tab.set_engine(EngineState.READY, harmony_url, None)
    shown: list[tuple[str, str, bool]] = []  # the transcript after each piece, as drawn anew, the piece in italics

    def streamed(piece: str) -> None:
        fresh = QTextDocument()
        fresh.setHtml(render(tab.current))
        text = tab.view.toPlainText()
        cursor = tab.view.textCursor()
        cursor.setPosition(text.rindex(piece) + 1)
        shown.append((text, fresh.toPlainText(), cursor.charFormat().fontItalic()))

    tab.piece_shown.connect(streamed)
    say(qtbot, tab, "Hello?", max_tokens=8)
    message = tab.current.messages[-1]
    assert (message["reasoning_content"], message["content"]) == ("T1 T2 ", "Preamble. Done.")
    head = "You\nHello?\nAssistant\n"
    assert [text for text, _, _ in shown] == [
        head + "Preamble. ", head + "T1 \nPreamble. ", head + "T1 T2 \nPreamble. ", head + "T1 T2 \nPreamble. Done."]
    assert all(text == fresh for text, fresh, _ in shown), shown  # as the end of the turn draws it
    assert [italic for _, _, italic in shown] == [False, True, True, False]  # each piece in its block's style
    assert tab.view.toPlainText().startswith(head + "T1 T2 \nPreamble. Done.\n")  # the turn's figures below


@pytest.mark.parametrize("event", [b"5", b"[]", b'{"choices": "x"}', b'{"choices": [{"delta": 3}]}'])
def test_an_event_of_another_shape_fails_the_turn_instead_of_leaving_it_answering(qtbot, event):
    """JSON, but not a chunk (what another server, or a proxy's page, may send): the turn fails with words; the
    worker used to die without a signal, the turn answering until Stop."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Odd(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.write(b"data: " + event + b"\n\n")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Odd)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        body = ChatStream(f"http://127.0.0.1:{server.server_address[1]}", None, [{"role": "user", "content": "hi"}],
                          max_tokens=4)
        with qtbot.waitSignal(body.failed, timeout=10000) as failed:
            body.start()
        assert "does not read" in failed.args[0] or "ended the stream" in failed.args[0], failed.args
        assert body.join(5)
    finally:
        server.shutdown()
