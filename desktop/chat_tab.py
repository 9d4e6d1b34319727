"""The Chat tab: try the model and watch the cache work, turn by turn.

Several conversations, each holding its messages; the answer streams in as the engine writes it (a worker thread
in `desktop.chat_stream`, never the GUI thread, talks to the engine). Below each answer: the prompt's tokens, how
many of them the engine reused instead of recomputing (`usage.prompt_tokens_details.cached_tokens`), the time to
the first token and the decode speed. Switching to another conversation and back shows the point of the cache:
the returning conversation's prompt comes back cached (restored from RAM or disk) and its first token comes fast.
"""

from __future__ import annotations

import html
import time
from dataclasses import dataclass, field

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QTextCursor, QTextDocument
from PySide6.QtWidgets import (
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QListWidget,
    QPushButton,
    QSpinBox,
    QSplitter,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from desktop.chat_stream import ChatStream, TurnStats
from desktop.engine_process import EngineState

TITLE_WORDS = 6
DEFAULT_MAX_TOKENS = 256


@dataclass
class Conversation:
    """One conversation's messages (OpenAI form) and the figures of its assistant turns, by message index."""

    messages: list[dict[str, str]] = field(default_factory=list)
    stats: dict[int, TurnStats] = field(default_factory=dict)

    @property
    def title(self) -> str:
        """The first words of the first user message, as the Monitor names conversations."""
        for m in self.messages:
            if m["role"] == "user":
                words = m["content"].split()
                return " ".join(words[:TITLE_WORDS]) + (" …" if len(words) > TITLE_WORDS else "")
        return "New conversation"


THOUGHT_STYLE = "color:#757575;font-style:italic;white-space:pre-wrap"


def drawn(message: dict[str, str], key: str) -> bool:
    """Whether `render` draws a block for the message's `key` ("content": the answer, "reasoning_content": the
    thought): a thought once it has text, the answer once it has text or when there is no thought."""
    if key == "reasoning_content":
        return bool(message.get(key))
    return bool(message["content"]) or not message.get("reasoning_content")


def render(conversation: Conversation, *, through_thought: bool = False) -> str:
    """The transcript as HTML: each message's thought (a thinking model's reasoning, in grey italics) above its
    answer, so the last block is the last message's answer. `through_thought`: stop after the last message's
    thought, the transcript up to where its next streamed reasoning piece goes."""
    blocks = []
    last = len(conversation.messages) - 1
    for i, m in enumerate(conversation.messages):
        who = "You" if m["role"] == "user" else "Assistant"
        blocks.append(f"<p style='margin-top:10px'><b>{who}</b></p>")
        if drawn(m, "reasoning_content"):
            blocks.append(f"<p style='{THOUGHT_STYLE}'>{html.escape(m['reasoning_content'])}</p>")
        if through_thought and i == last:
            break
        if drawn(m, "content"):
            blocks.append(f"<p style='white-space:pre-wrap'>{html.escape(m['content'])}</p>")
        stats = conversation.stats.get(i)
        if stats is not None:
            blocks.append(f"<p style='color:#616161'><small>{html.escape(stats.summary())}</small></p>")
    return "".join(blocks)


class ChatTab(QWidget):
    """Conversations on the left; the transcript, the message box, Send and Stop on the right."""

    piece_shown = Signal(str)  # a streamed piece was added to the transcript on screen
    turn_finished = Signal(object)  # TurnStats of a turn the engine completed
    turn_stopped = Signal(object)  # TurnStats of a turn the user stopped
    turn_failed = Signal(str)
    changed = Signal()  # a turn ended (answered, stopped or failed): the transcripts are worth saving

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.conversations: list[Conversation] = []
        self.current: Conversation | None = None
        self.stream: ChatStream | None = None
        self.streaming: Conversation | None = None  # the conversation the running stream answers
        self._first_piece_at: float | None = None
        # Where the shown streamed answer's next reasoning piece goes: the end of its thought's block, above the
        # answer (kept by Qt as text is inserted before it); None while no thought is drawn.
        self._thought_end: QTextCursor | None = None
        self.base_url: str | None = None
        self.api_key: str | None = None
        self.ready = False

        self.new_button = QPushButton("New conversation")
        self.new_button.clicked.connect(self.new_conversation)
        self.list = QListWidget()
        self.list.currentRowChanged.connect(self._picked)
        side = QWidget()
        side_layout = QVBoxLayout(side)
        side_layout.setContentsMargins(0, 0, 0, 0)
        side_layout.addWidget(self.new_button)
        side_layout.addWidget(self.list, 1)

        self.status = QLabel()
        self.status.setObjectName("chatStatus")
        self.status.setWordWrap(True)
        self.view = QTextBrowser()
        self.view.setOpenExternalLinks(False)
        self.input = QLineEdit()
        self.input.setPlaceholderText("Write a message and press Enter")
        self.input.returnPressed.connect(self.send)
        self.send_button = QPushButton("Send")
        self.send_button.clicked.connect(self.send)
        self.stop_button = QPushButton("Stop")
        self.stop_button.clicked.connect(self.stop)
        self.max_tokens = QSpinBox()
        self.max_tokens.setRange(1, 32768)
        self.max_tokens.setValue(DEFAULT_MAX_TOKENS)
        self.max_tokens.setPrefix("up to ")
        self.max_tokens.setSuffix(" tokens")
        self.max_tokens.setFocusPolicy(Qt.FocusPolicy.StrongFocus)  # no value change on a passing wheel
        row = QHBoxLayout()
        row.addWidget(self.input, 1)
        row.addWidget(self.max_tokens)
        row.addWidget(self.send_button)
        row.addWidget(self.stop_button)
        main = QWidget()
        main_layout = QVBoxLayout(main)
        main_layout.setContentsMargins(0, 0, 0, 0)
        main_layout.addWidget(self.status)
        main_layout.addWidget(self.view, 1)
        main_layout.addLayout(row)

        splitter = QSplitter()
        splitter.addWidget(side)
        splitter.addWidget(main)
        splitter.setStretchFactor(1, 1)
        splitter.setSizes([220, 700])
        layout = QVBoxLayout(self)
        layout.addWidget(splitter)

        self.new_conversation()
        self.set_engine(EngineState.STOPPED, None, None)

    # ------------------------------------------------------------------ engine

    def set_engine(self, state: EngineState, base_url: str | None, api_key: str | None) -> None:
        """The engine's state and where it listens; chatting is possible only while it is Ready."""
        self.ready = state is EngineState.READY and base_url is not None
        self.base_url, self.api_key = base_url, api_key
        if not self.ready and self.stream is not None:
            self._end_stream(stopped=True)
        if self.ready:
            self.status.setText("Below each answer: the prompt's tokens, how many the cache gave back instead of "
                                "recomputing them, the time to the first token and the speed. Switch to another "
                                "conversation and back to see a parked conversation restored.")
        else:
            self.status.setText(f"The engine is {state.label.rstrip('…').lower()}: start it (Start engine, above) "
                                "to chat. Conversations typed so far are kept.")
        self._update_controls()

    # ------------------------------------------------------------------ conversations

    def new_conversation(self) -> None:
        self.conversations.append(Conversation())
        self.list.addItem("New conversation")
        self.list.setCurrentRow(len(self.conversations) - 1)
        self.input.setFocus()

    def restore(self, conversations: list[Conversation]) -> None:
        """Conversations kept from an earlier launch, listed in place of the empty one; the latest is shown."""
        if not conversations:
            return
        self.conversations = list(conversations)
        self.list.clear()
        for conversation in self.conversations:
            self.list.addItem(conversation.title)
            self._retitle(conversation)
        self.list.setCurrentRow(len(self.conversations) - 1)

    def kept(self) -> list[Conversation]:
        """The conversations worth keeping across launches: those with messages."""
        return [c for c in self.conversations if c.messages]

    def pick(self, index: int) -> None:
        """Show conversation `index` (0 = the first made)."""
        assert 0 <= index < len(self.conversations), index
        self.list.setCurrentRow(index)

    def _picked(self, row: int) -> None:
        if row < 0:
            return
        self.current = self.conversations[row]
        self._show()

    def _show(self) -> None:
        assert self.current is not None
        self.view.setHtml(render(self.current))
        self._thought_end = None
        if self.current is self.streaming and drawn(self.current.messages[-1], "reasoning_content"):
            # Its position is the length of the transcript drawn up to the thought's end (the same blocks).
            head = QTextDocument()
            head.setHtml(render(self.current, through_thought=True))
            self._thought_end = QTextCursor(self.view.document())
            self._thought_end.setPosition(head.characterCount() - 1)
        self.view.moveCursor(QTextCursor.MoveOperation.End)
        self.view.ensureCursorVisible()

    def _retitle(self, conversation: Conversation) -> None:
        row = self.conversations.index(conversation)
        item = self.list.item(row)
        item.setText(conversation.title)
        system = next((m["content"] for m in conversation.messages if m["role"] == "system"), "")
        item.setToolTip(system[:200])

    # ------------------------------------------------------------------ a turn

    def send(self) -> None:
        """Send the typed message in the shown conversation and stream the answer into it."""
        text = self.input.text().strip()
        if not text or not self.ready or self.stream is not None or self.current is None:
            return
        assert self.base_url is not None
        conversation = self.current
        conversation.messages.append({"role": "user", "content": text})
        stream = ChatStream(self.base_url, self.api_key, conversation.messages,
                            max_tokens=self.max_tokens.value(), parent=self)
        conversation.messages.append({"role": "assistant", "content": ""})
        self.input.clear()
        self._retitle(conversation)
        self._show()
        self.stream, self.streaming, self._first_piece_at = stream, conversation, None
        stream.delta.connect(lambda piece: self._on_piece(stream, piece, "content"))
        stream.thought.connect(lambda piece: self._on_piece(stream, piece, "reasoning_content"))
        stream.finished.connect(lambda stats: self._on_finished(stream, stats))
        stream.failed.connect(lambda message: self._on_failed(stream, message))
        stream.start()
        self._update_controls()

    def stop(self) -> None:
        """Cancel the running answer; what came so far stays in the conversation."""
        if self.stream is not None:
            self._end_stream(stopped=True)

    def _on_piece(self, stream: ChatStream, piece: str, key: str) -> None:
        """A streamed piece of the answer (`key` "content") or of its reasoning ("reasoning_content")."""
        if stream is not self.stream or self.streaming is None:
            return  # a stopped stream's last queued pieces
        if self._first_piece_at is None:
            self._first_piece_at = time.perf_counter()
        message = self.streaming.messages[-1]
        # The first piece of a block not drawn yet (the thought's first; the answer's first after a thought) draws
        # the transcript anew; any other goes where its block ends, whichever kind came last (gpt-oss may write
        # a preamble of its answer, then reason more): a thought's piece at the thought's end, an answer's at the end.
        new_block = not drawn(message, key)
        message[key] = message.get(key, "") + piece
        if self.streaming is not self.current:
            return
        if new_block:
            self._show()
        else:
            if key == "reasoning_content":
                assert self._thought_end is not None, "a drawn thought has a cursor at its end"
                cursor = self._thought_end
            else:
                cursor = self.view.textCursor()
                cursor.movePosition(QTextCursor.MoveOperation.End)
            cursor.insertText(piece)
            self.view.setTextCursor(cursor)
            self.view.ensureCursorVisible()
        self.piece_shown.emit(piece)

    def _on_finished(self, stream: ChatStream, stats: TurnStats) -> None:
        if stream is not self.stream:
            return
        self._end_stream(stats=stats)
        self.turn_finished.emit(stats)

    def _on_failed(self, stream: ChatStream, message: str) -> None:
        if stream is not self.stream:
            return
        self._end_stream(error=message)
        self.turn_failed.emit(message)

    def _end_stream(self, *, stats: TurnStats | None = None, stopped: bool = False, error: str = "") -> None:
        stream, conversation = self.stream, self.streaming
        assert stream is not None and conversation is not None
        stream.cancel()
        self.stream = self.streaming = None
        index = len(conversation.messages) - 1
        if stopped:
            started = stream.started_at or time.perf_counter()
            ttft = None if self._first_piece_at is None else self._first_piece_at - started
            stats = TurnStats(None, None, None, ttft, time.perf_counter() - started, stopped=True)
        if stats is not None:
            conversation.stats[index] = stats
        if error:
            if not conversation.messages[index]["content"] and not conversation.messages[index].get("reasoning_content"):
                # Nothing came: take the turn back and put the message in the box again, to be sent again.
                conversation.messages.pop()
                self.input.setText(conversation.messages.pop()["content"])
                self._retitle(conversation)
            self.status.setText(error)
        if conversation is self.current:
            self._show()
        self._update_controls()
        self.changed.emit()
        if stopped:
            self.turn_stopped.emit(stats)

    def _update_controls(self) -> None:
        idle = self.stream is None
        self.input.setEnabled(self.ready)
        self.send_button.setEnabled(self.ready and idle)
        self.stop_button.setEnabled(not idle)
        self.max_tokens.setEnabled(idle)

    def shutdown(self, wait_s: float = 2.0) -> None:
        """Cancel a running answer and give its worker a moment to drop the connection."""
        stream = self.stream
        if stream is not None:
            self._end_stream(stopped=True)
            stream.join(wait_s)

    def last_stats(self, conversation: Conversation | None = None) -> TurnStats | None:
        """The figures of the latest assistant turn in `conversation` (the shown one by default), or None."""
        conversation = conversation or self.current
        if conversation is None or not conversation.stats:
            return None
        return conversation.stats[max(conversation.stats)]
