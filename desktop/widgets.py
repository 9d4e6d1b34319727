"""Small widget behaviours shared by the tabs."""

from __future__ import annotations

from PySide6.QtCore import QEvent, QObject, Qt
from PySide6.QtGui import QFont, QTextOption
from PySide6.QtWidgets import (
    QAbstractScrollArea,
    QAbstractSpinBox,
    QApplication,
    QComboBox,
    QPlainTextEdit,
    QWidget,
)


class WheelGuard(QObject):
    """Lets a combo box or spin box take the mouse wheel only while it has the keyboard focus.

    Otherwise scrolling a long page over one of them would change (and autosave) its value. The event goes
    to the scroll area around the editor instead, so the page scrolls as the user meant.
    """

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:
        if event.type() != QEvent.Type.Wheel or not isinstance(watched, QWidget) or watched.hasFocus():
            return False
        area = watched.parentWidget()
        while area is not None and not isinstance(area, QAbstractScrollArea):
            area = area.parentWidget()
        if area is not None:
            # Sent, not left to propagate: Qt does not propagate synthesized wheel events to parents.
            QApplication.sendEvent(area.viewport(), event)
        return True  # never delivered to the editor


def guard_wheel(root: QWidget) -> WheelGuard:
    """Install one WheelGuard on every combo box and spin box under `root` (and stop the wheel giving focus)."""
    guard = WheelGuard(root)
    for editor in [*root.findChildren(QComboBox), *root.findChildren(QAbstractSpinBox)]:
        editor.setFocusPolicy(Qt.FocusPolicy.StrongFocus)  # the default WheelFocus would take focus on a scroll
        editor.installEventFilter(guard)
    return guard


class CommandView(QPlainTextEdit):
    """A read-only command line shown whole: wrapped to the width (anywhere, a long path included), in a
    monospace font, a few lines high and scrolling beyond, selectable. It never widens the window.
    """

    LINES = 3

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setReadOnly(True)
        self.setLineWrapMode(QPlainTextEdit.LineWrapMode.WidgetWidth)
        self.setWordWrapMode(QTextOption.WrapMode.WrapAtWordBoundaryOrAnywhere)
        mono = QFont("monospace")
        mono.setStyleHint(QFont.StyleHint.Monospace)
        self.setFont(mono)
        margins = self.contentsMargins()
        height = self.fontMetrics().lineSpacing() * self.LINES + 2 * self.document().documentMargin()
        self.setFixedHeight(int(height) + margins.top() + margins.bottom() + 2)

    def text(self) -> str:
        return self.toPlainText()

    def setText(self, text: str) -> None:  # noqa: N802 - the name QLineEdit and QLabel use
        self.setPlainText(text)
