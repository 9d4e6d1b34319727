"""`strata-desktop` and `python -m desktop`: parse the command line, keep one instance, show the main window.

Nothing heavy is imported at module level: a frozen build re-runs this entry point as the engine child
(`strata-desktop serve ...`), which must not load Qt, and the GUI process must never load torch.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="strata-desktop",
                                     description="Strata Desktop: a local LLM server with a conversation cache.")
    parser.add_argument("--install-desktop-entry", action="store_true",
                        help="install a launcher and icon for this user (Linux), then exit")
    parser.add_argument("--config-dir", type=Path, help="folder for the settings file (default: the user config folder)")
    parser.add_argument("--state-dir", type=Path, help="folder for the engine pid file (default: the user state folder)")
    parser.add_argument("--log-dir", type=Path,
                        help="folder for the log files (default: the user log folder; with --state-dir, its logs/)")
    parser.add_argument("--no-engine", action="store_true", help="do not start the engine at launch")
    parser.add_argument("--hidden", action="store_true", help="start in the tray, without showing the window")
    parser.add_argument("--print-startup-time", action="store_true",
                        help="print the seconds from launch to the first painted window, then keep running")
    from desktop import __version__

    parser.add_argument("--version", action="version", version=f"strata-desktop {__version__}")
    return parser.parse_args(argv)


def _process_age() -> float:
    """Seconds since this process started. On Linux from /proc (psutil's create_time rounds the boot time to 1 s)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        import psutil

        return time.time() - psutil.Process().create_time()


def _report_first_paint(window: object) -> None:
    """Print the seconds from process start to the main window's first paint (for docs/BENCHMARKS.md)."""
    from PySide6.QtCore import QEvent, QObject

    started = time.time() - _process_age()

    class FirstPaint(QObject):
        def eventFilter(self, obj: QObject, event: QEvent) -> bool:  # noqa: N802 - Qt's name
            if event.type() == QEvent.Type.Paint:
                window.removeEventFilter(self)  # type: ignore[attr-defined]
                print(f"strata-desktop: window painted {time.time() - started:.3f} s after the process started",
                      file=sys.stderr, flush=True)
            return False

    watcher = FirstPaint(window)  # type: ignore[arg-type]
    window.installEventFilter(watcher)  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        # The frozen app's engine mode (see desktop.engine_process.engine_command): no Qt in this process.
        from engine.cli import main as engine_main

        return int(engine_main(argv) or 0)
    args = parse_args(argv)
    if args.install_desktop_entry:
        from desktop.desktop_entry import install_desktop_entry

        for path in install_desktop_entry():
            print(f"installed {path}")
        return 0

    from PySide6.QtCore import QTimer

    from desktop.instance import SingleInstance, instance_lock, instance_name, notify_running
    from desktop.quit_requests import Application
    from desktop.settings import Paths

    defaults = Paths.default()
    paths = Paths(config_dir=args.config_dir or defaults.config_dir, state_dir=args.state_dir or defaults.state_dir,
                  log_dir=args.log_dir or (None if args.state_dir else defaults.log_dir),
                  data_dir=None if args.state_dir else defaults.data_dir)
    app = Application([sys.argv[0], *argv])
    app.setApplicationName("Strata Desktop")
    app.setDesktopFileName("strata-desktop")
    app.setQuitOnLastWindowClosed(False)  # the window may close to the tray; quitting is explicit

    name = instance_name(paths.config_dir)
    lock = instance_lock(paths.config_dir)  # held for the app's life (this frame runs the event loop)
    if lock is False:  # a live instance holds the settings folder: it shows its window, this one ends
        shown = notify_running(name, timeout_ms=5000)
        print("strata-desktop: already running; " + ("showed its window" if shown else "it did not answer"),
              file=sys.stderr)
        return 0
    instance = SingleInstance(name, app)
    if not instance.listen():
        print(f"strata-desktop: cannot listen for later launches on {name}: {instance.server.errorString()}",
              file=sys.stderr)

    from desktop.main_window import MainWindow

    window = MainWindow(paths)
    if args.no_engine:
        window.store.prefs.start_engine = False
    instance.activated.connect(window.show_window)
    # Every way out is the one clean quit (desktop/quit_requests.py); aboutToQuit's teardown also stops the
    # engine cleanly, for Windows ending the session, which ends the event loop without asking.
    app.aboutToQuit.connect(window.shutdown_now)
    app.aboutToQuit.connect(instance.close)
    app.route_quits(window.request_quit)
    app.quit_on_signals(window.quit)
    app.quit_on_close_requests(window.quit)
    if not (args.hidden and window.use_tray):
        window.show()
    if args.print_startup_time:
        _report_first_paint(window)
    if window.isVisible():
        # Plots, the HTTP client and the engine start once the window is on screen.
        window.first_painted.connect(lambda: QTimer.singleShot(0, window.start))
        QTimer.singleShot(3000, window.start)  # in case no paint ever comes (e.g. an unmapped window)
    else:
        QTimer.singleShot(0, window.start)
    return app.exec()


if __name__ == "__main__":
    sys.exit(main())
