"""The engine's output and the app's own lines, kept in rotating files in the platform's log folder.

Writes go through a queue to a listener thread (the standard library's QueueListener), so a slow disk never
stalls the window. `engine.log` holds what the engine printed; `desktop.log` what the app said about it
(lines starting "strata-desktop:"). Each rotates at MAX_BYTES, keeping BACKUPS old files.
"""

from __future__ import annotations

import logging
import logging.handlers
import queue
from pathlib import Path

MAX_BYTES = 5 * 1024 * 1024
BACKUPS = 3
APP_PREFIX = "strata-desktop: "
ENGINE_LOG, DESKTOP_LOG = "engine.log", "desktop.log"


class LogFiles:
    """One pair of rotating log files in `folder`; `write_line` is safe to call from the GUI thread."""

    def __init__(self, folder: Path, max_bytes: int = MAX_BYTES, backups: int = BACKUPS) -> None:
        self.folder = folder
        self.error = ""  # why the files cannot be written, when they cannot ("" when they can)
        self._queue: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
        self._listener: logging.handlers.QueueListener | None = None
        try:
            folder.mkdir(parents=True, exist_ok=True)
            handlers = []
            for stream, name in (("engine", ENGINE_LOG), ("desktop", DESKTOP_LOG)):
                handler = logging.handlers.RotatingFileHandler(folder / name, maxBytes=max_bytes,
                                                               backupCount=backups, encoding="utf-8", delay=True)
                handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
                handler.addFilter(logging.Filter(stream))  # each file takes its own stream's records
                handlers.append(handler)
        except OSError as e:
            self.error = f"Logs are not kept on disk: cannot use {folder}: {e.strerror or e}"
            return
        self._listener = logging.handlers.QueueListener(self._queue, *handlers)
        self._listener.start()

    def write_line(self, line: str) -> None:
        """Queue one line for its file: the app's own lines to desktop.log, everything else to engine.log."""
        if self._listener is None:
            return
        stream = "desktop" if line.startswith(APP_PREFIX) else "engine"
        record = logging.LogRecord(stream, logging.INFO, __file__, 0, line, None, None)
        self._queue.put(record)

    def close(self) -> None:
        """Write what is queued and close the files (at quit)."""
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.stop()
            for handler in listener.handlers:
                handler.close()
