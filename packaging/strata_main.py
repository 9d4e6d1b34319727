"""The packaged app's one entry point: `strata-desktop` is the GUI, `strata-desktop serve ...` the engine.

The engine mode is dispatched before anything imports Qt, and the GUI never imports torch, so the one
executable serves both roles: the app starts its engine child as `[sys.executable, "serve", ...]`
(desktop.engine_process.engine_command).
"""

from __future__ import annotations

import os
import sys


def _ensure_std_streams() -> None:
    """A windowed build has no console: give print() somewhere to go when no pipe was handed to us."""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        if getattr(sys, name) is None:
            try:
                stream = open(fd, "w", encoding="utf-8", errors="replace", buffering=1, closefd=False)  # noqa: SIM115
            except OSError:
                stream = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115
            setattr(sys, name, stream)


def main() -> int:
    _ensure_std_streams()
    argv = sys.argv[1:]
    if argv[:1] == ["serve"]:
        from engine.cli import main as engine_main

        return int(engine_main(argv) or 0)
    from desktop.app import main as desktop_main

    return int(desktop_main(argv) or 0)


if __name__ == "__main__":
    import multiprocessing

    multiprocessing.freeze_support()
    sys.exit(main())
