"""One app per user and settings folder: a second launch asks the first to show its window, then exits."""

from __future__ import annotations

import getpass
import hashlib
from pathlib import Path

from PySide6.QtCore import QLockFile, QObject, Signal
from PySide6.QtNetwork import QLocalServer, QLocalSocket

LOCK_NAME = "strata-desktop.lock"


def instance_lock(config_dir: Path) -> QLockFile | bool:
    """The settings folder's lock, held for the app's life; False when a live instance holds it; True when no lock
    can be had there (a read-only folder: the app runs, as before there was one). Taken before the local socket:
    two launches close together both found no one listening, and the second's listen() removed the first's
    socket (on Windows both could listen). A lock left by a dead instance is taken over."""
    try:
        config_dir.mkdir(parents=True, exist_ok=True)
    except OSError:
        return True
    lock = QLockFile(str(config_dir / LOCK_NAME))
    lock.setStaleLockTime(0)  # stale only when its process is gone, however old
    if lock.tryLock(200):
        return lock
    return lock.error() is not QLockFile.LockError.LockFailedError


def instance_name(config_dir: Path) -> str:
    """A local-socket name unique to this user and settings folder."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "user"
    digest = hashlib.sha1(f"{user}\0{config_dir.resolve()}".encode()).hexdigest()[:16]
    return f"strata-desktop-{digest}"


def notify_running(name: str, timeout_ms: int = 1000) -> bool:
    """If an instance listens on `name`, ask it to show its window and return True."""
    socket = QLocalSocket()
    socket.connectToServer(name)
    if not socket.waitForConnected(timeout_ms):
        return False
    socket.write(b"show\n")
    socket.flush()
    socket.waitForBytesWritten(timeout_ms)
    socket.disconnectFromServer()
    return True


class SingleInstance(QObject):
    """Listens for later launches; `activated` fires when one asks this instance to show itself."""

    activated = Signal()

    def __init__(self, name: str, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.name = name
        self.server = QLocalServer(self)
        self.server.setSocketOptions(QLocalServer.SocketOption.UserAccessOption)
        self.server.newConnection.connect(self._on_connection)

    def listen(self) -> bool:
        """Start listening; a socket file left by a crashed instance is removed first (callers hold the
        `instance_lock`, so no live instance listens on it)."""
        if self.server.listen(self.name):
            return True
        QLocalServer.removeServer(self.name)
        return self.server.listen(self.name)

    def close(self) -> None:
        self.server.close()

    def _on_connection(self) -> None:
        while self.server.hasPendingConnections():
            socket = self.server.nextPendingConnection()
            socket.readyRead.connect(self._read)
            socket.disconnected.connect(socket.deleteLater)
            if socket.bytesAvailable():
                self._read_from(socket)

    def _read(self) -> None:
        socket = self.sender()
        if isinstance(socket, QLocalSocket):
            self._read_from(socket)

    def _read_from(self, socket: QLocalSocket) -> None:
        data = bytes(socket.readAll().data())
        if b"show" in data:
            self.activated.emit()
