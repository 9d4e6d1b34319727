"""`strata serve`: flags -> EngineConfig -> HTTP server, with the model loading behind /health.

Exit status: 0 after a clean shutdown, 2 for a bad flag or a model that cannot be loaded.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import stat
import sys
import threading
from dataclasses import fields

from engine import __version__
from engine.config import EngineConfig
from engine.setting import Setting, SettingError

log = logging.getLogger("strata")

# How long a clean shutdown may take to park live slots and spill the tiered cache to disk.
SHUTDOWN_DEADLINE_S = 60.0


def build_parser() -> argparse.ArgumentParser:
    """argparse for `strata`, generated from the settings table: every flag, its help, unit and default."""
    parser = argparse.ArgumentParser(prog="strata", description="Strata: a local LLM server with a conversation cache.")
    parser.add_argument("--version", action="version", version=f"strata {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API, with the conversation cache.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    groups = {
        "model": serve.add_argument_group("model"),
        "runtime": serve.add_argument_group("runtime"),
        "server": serve.add_argument_group("server"),
        "cache": serve.add_argument_group("conversation cache"),
    }
    for f in fields(EngineConfig):
        spec: Setting = f.metadata["setting"]
        help_text = spec.help + (f" [{spec.unit}]" if spec.unit else "")
        kwargs: dict = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_text + f" (default: {_shown(f.default)})"}
        if spec.choices:
            kwargs["metavar"] = "{" + ",".join(spec.choices) + "}"
        elif spec.metavar:
            kwargs["metavar"] = spec.metavar
        else:
            kwargs["metavar"] = "N" if spec.kind in ("int", "float") else "VALUE"
        if spec.kind == "bool":  # a switch: `--flag` alone means true; `--flag false` as to_args writes it
            kwargs.update(nargs="?", const="true", metavar="true|false")
        aliases = [spec.flag] + (["-m"] if f.name == "model" else [])
        groups[spec.group].add_argument(*aliases, **kwargs)
    return parser


def _shown(value: object) -> str:
    if value in ("", None):
        return "unset"
    return str(value)


def parse_config(argv: list[str]) -> EngineConfig:
    """EngineConfig from `serve` arguments; raises SettingError naming the flag, the expectation and the value."""
    parser = build_parser()
    args = parser.parse_args(["serve", *argv])
    values = {k: v for k, v in vars(args).items() if k != "command"}
    return EngineConfig(**values)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or (argv[0] != "serve" and not argv[0].startswith("-")):
        parser.print_help()
        return 2
    if argv[0] != "serve":
        parser.parse_args(argv)  # --help / --version
        return 0
    try:
        config = parse_config(argv[1:])
    except SettingError as exc:
        print(f"strata serve: error: {exc}", file=sys.stderr)
        return 2
    sleeping_cpu_workers()
    return serve(config)


def sleeping_cpu_workers() -> None:
    """Make idle OpenMP workers sleep after a short spin instead of spinning long (OMP_WAIT_POLICY=PASSIVE and
    GOMP_SPINCOUNT=1000 unless the environment says otherwise); the OpenMP runtime reads them once, when torch
    loads, so this runs before torch is imported.

    A spinning worker that shares its core with another busy process is off the CPU whenever a parallel
    region starts, and every one of a decode step's ~120 matmuls waits for it: measured on 2 cores with one
    of them busy, decode fell from ~100 to 0.6 tok/s with the default policy (300,000 spins) and to ~58 tok/s
    with sleeping workers. But a worker that sleeps at once takes longer to wake than a step's products take:
    the native decode step of the bundled model on two threads, quiet, took 14.9 ms with no spin, 9.5 ms with
    1,000 spins and 7.4 ms with 10,000, against 13.8 ms on one thread; with a busy loop on one core, 13.8, 22.2
    and 58.3 ms (one thread: 11.6). 1,000 keeps most of the gain and bounds the loss, and the decode thread
    count is timed as the engine runs (engine/runtime/threads.py), so a busy machine decodes on one thread.
    Prefill of 512 tokens on two threads: 349 / 368 tok/s quiet, 197 / 204 busy, without / with the spin.
    """
    if "torch" in sys.modules:
        log.debug("torch already loaded: the OpenMP wait policy stays %s", os.environ.get("OMP_WAIT_POLICY", "unset"))
        return
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("GOMP_SPINCOUNT", "1000")  # libgomp's (Linux, MinGW); other runtimes ignore it


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    if os.name != "nt":  # on Windows SO_REUSEADDR lets two servers share a port
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def serve(config: EngineConfig) -> int:
    """Run the HTTP server until SIGINT/SIGTERM, POST /shutdown or stdin closing; then shut down cleanly."""
    import uvicorn

    from engine.server.app import ServerState, create_app
    from engine.server.http_protocol import HeadDeadlineProtocol

    _setup_logging(config.log_level)
    try:
        sock = _bind(config.host, config.port)
    except OSError as exc:
        print(f"strata serve: error: --host/--port: cannot listen on {config.host}:{config.port}: {exc.strerror}",
              file=sys.stderr)
        return 2
    host, port = sock.getsockname()[:2]

    state = ServerState(config=config)
    app = create_app(state)
    server = _Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                                    timeout_graceful_shutdown=5, http=HeadDeadlineProtocol))
    outcome = {"exit": 0}

    def request_shutdown() -> None:
        log.info("shutdown requested")
        engine = state.engine
        if engine is not None:
            # End the requests in flight first (their streams get their last event and finish), so the server's
            # graceful shutdown has none to cancel; the live slots are parked meanwhile.
            threading.Thread(target=engine.close, kwargs={"deadline_s": SHUTDOWN_DEADLINE_S},
                             name="strata-close", daemon=True).start()
        server.should_exit = True

    state.shutdown = request_shutdown
    _on_signals(request_shutdown)

    def load() -> None:
        from engine.cache.errors import CacheError
        from engine.errors import ModelLoadError
        from engine.runtime.engine import Engine

        try:
            engine = Engine.from_config(config, state.progress)
        except CacheError as exc:
            print(f"strata serve: error: conversation cache: {exc}", file=sys.stderr, flush=True)
            outcome["exit"] = 2
            server.should_exit = True
            return
        except (ModelLoadError, ValueError, OSError) as exc:
            print(f"strata serve: error: cannot load the model: {exc}", file=sys.stderr, flush=True)
            outcome["exit"] = 2
            server.should_exit = True
            return
        except Exception as exc:  # noqa: BLE001 - any loader failure must end in one clear line, exit 2
            log.exception("model load failed")
            print(f"strata serve: error: cannot load the model: {exc}", file=sys.stderr, flush=True)
            outcome["exit"] = 2
            server.should_exit = True
            return
        state.engine = engine
        devices = ",".join(str(s.device) for s in engine.kv.stages)
        log.info("model %s ready on %s: %d slots x %d tokens, K/V %.0f MiB", engine.model_name, devices,
                 engine.n_slots, engine.ctx_size, engine.kv.nbytes / 2**20)

    _watch_stdin(request_shutdown)
    loader = threading.Thread(target=load, name="strata-load", daemon=True)
    loader.start()
    shown_host = f"[{host}]" if ":" in str(host) else host
    print(f"strata: listening on http://{shown_host}:{port}", file=sys.stderr, flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        loader.join(timeout=600)
        if state.engine is not None:
            state.engine.close(deadline_s=SHUTDOWN_DEADLINE_S)
            log.info("engine stopped")
    return outcome["exit"]


def _make_server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn without its own signal handling: it re-raises SIGTERM after serving, which would kill the
        process before the engine parks and spills. Our handlers only ask the server to stop."""

        @contextlib.contextmanager
        def capture_signals(self):
            yield

        def install_signal_handlers(self) -> None:
            pass

    return Server


def _Server(config):  # noqa: N802 - reads like the class it builds
    return _make_server_class()(config)


def _on_signals(stop) -> None:
    """SIGINT and SIGTERM (and Ctrl+Break on Windows) start a clean shutdown; a second one forces exit."""
    seen = {"n": 0}

    def handle(signum, _frame) -> None:
        seen["n"] += 1
        if seen["n"] > 1:
            log.warning("second signal: exiting without a clean shutdown")
            os._exit(130)
        log.info("signal %d received: shutting down cleanly", signum)
        stop()

    for name in ("SIGINT", "SIGTERM", "SIGBREAK"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), handle)


def _watch_stdin(on_close) -> None:
    """Shut down when stdin is a pipe and it closes (a parent process that went away)."""
    try:
        mode = os.fstat(sys.stdin.fileno()).st_mode
    except (OSError, ValueError, AttributeError):
        return
    if not stat.S_ISFIFO(mode):
        return

    fd = sys.stdin.fileno()

    def wait() -> None:
        # os.read on the descriptor, not sys.stdin: a thread blocked inside sys.stdin's buffered reader holds its
        # lock, and the interpreter aborts at exit when it cannot take that lock.
        try:
            while os.read(fd, 4096):
                pass
        except OSError:
            pass
        log.info("stdin closed")
        on_close()

    threading.Thread(target=wait, name="strata-stdin", daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
