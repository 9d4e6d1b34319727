"""Every way the app is asked to end reaches one quit, which stops the engine through its own clean shutdown (it
parks its live slots and spills a tiered cache to disk) before the event loop ends.

- Tray → Quit, and the main window closed where there is no tray: `MainWindow.quit`.
- A quit request sent to the application (QEvent.Quit: QCoreApplication.quit() from Qt or the platform):
  `Application` hands it to the quit handler until that handler says the app may end.
- A close request to a window nobody can see: `Application.quit_on_close_requests`, a window created and never
  shown. On Windows, taskkill (without /F), an uninstaller or Task Manager's "End task" post WM_CLOSE to the
  top-level windows of the process, shown or not; a person can only close a shown one, so a close of this
  window is always such a request (the main window's may be a click on its close button, which keeps serving
  from the tray).
- SIGINT and SIGTERM, and SIGBREAK on Windows (Ctrl+Break, or the console the app was started from closing):
  `Application.quit_on_signals`.
- Windows ending the session (WM_ENDSESSION): Qt emits aboutToQuit itself, without a quit request, and the
  process is ended when the message returns; the window's teardown, connected to aboutToQuit, stops the engine
  cleanly and waits for it there.
"""

from __future__ import annotations

import contextlib
import signal
import socket
from collections.abc import Callable

from PySide6.QtCore import QEvent, QSocketNotifier
from PySide6.QtGui import QCloseEvent, QWindow
from PySide6.QtWidgets import QApplication

QuitHandler = Callable[[], bool]  # True: the app may end now; False: a clean quit is under way, it ends the app


class Application(QApplication):
    """The QApplication whose quit requests go through one handler (`route_quits`), signals included
    (`quit_on_signals`)."""

    def __init__(self, argv: list[str]) -> None:
        super().__init__(argv)
        self._quit_handler: QuitHandler | None = None
        self._signal_wakeup: tuple[socket.socket, socket.socket, QSocketNotifier] | None = None
        self._sentinel: CloseSentinel | None = None

    def route_quits(self, handler: QuitHandler) -> None:
        self._quit_handler = handler

    def event(self, event: QEvent) -> bool:
        if event.type() == QEvent.Type.Quit and self._quit_handler is not None and not self._quit_handler():
            event.ignore()
            return True
        return super().event(event)

    def quit_on_signals(self, on_quit: Callable[[], object]) -> None:
        """SIGINT, SIGTERM (and SIGBREAK where it exists) call `on_quit` in the event loop: a socket the loop
        watches is written on each signal, so Python gets control and runs the handler promptly."""
        rsock, wsock = socket.socketpair()
        rsock.setblocking(False)
        wsock.setblocking(False)
        signal.set_wakeup_fd(wsock.fileno(), warn_on_full_buffer=False)
        notifier = QSocketNotifier(rsock.fileno(), QSocketNotifier.Type.Read, self)

        def drain() -> None:
            with contextlib.suppress(OSError):
                rsock.recv(64)

        notifier.activated.connect(drain)
        self._signal_wakeup = (rsock, wsock, notifier)
        for name in ("SIGINT", "SIGTERM", "SIGBREAK"):
            if hasattr(signal, name):
                signal.signal(getattr(signal, name), lambda *_: on_quit())

    def quit_on_close_requests(self, on_close: Callable[[], object]) -> None:
        """Call `on_close` when the system or a program asks the app's windows to close (`CloseSentinel`)."""
        self._sentinel = CloseSentinel(on_close)


class CloseSentinel(QWindow):
    """A window created (so the platform knows it) and never shown: its close event is a program's or the
    system's request that the app end, never a person's click."""

    def __init__(self, on_close: Callable[[], object]) -> None:
        super().__init__()
        self._on_close = on_close
        self.setTitle("Strata Desktop")
        self.create()

    def closeEvent(self, event: QCloseEvent) -> None:  # noqa: N802 - Qt's name
        event.ignore()  # the window stays, so a later request reaches it too
        self._on_close()
