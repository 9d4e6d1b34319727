"""What tools/agent_api_bench.py and tools/agent_record.py share: the server children (`strata serve`, llama-server),
the recorded sessions' folder, the load average."""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tools.alternating_bench import Server  # noqa: E402

SESSIONS = REPO / "tools" / "agent_sessions"
DEFAULT_SESSIONS = (SESSIONS / "claude_code.jsonl", SESSIONS / "codex.jsonl")
GENERATION_PATHS = ("/v1/messages", "/v1/responses", "/v1/chat/completions")  # what is replayed (not count_tokens)
TURN_TIMEOUT_S = 900


class Child(Server):
    """A server child as tools/alternating_bench.py starts one, with stdin from /dev/null: `strata serve` stops
    when its stdin closes, which a piped or closed stdin of this tool's own would do."""

    def __init__(self, argv: list[str]) -> None:
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)  # noqa: SIM115 - lives with the child
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.base = ""

    def stop(self) -> None:
        super().stop()
        self.log.close()
        with contextlib.suppress(OSError):
            os.remove(self.log.name)


def load() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def model_path(arg: str) -> str:
    from engine.model.loader import embedded_model_path

    return arg or str(embedded_model_path())


def strata_argv(path: str, port: int, args: argparse.Namespace) -> list[str]:
    argv = [sys.executable, "-m", "engine", "serve", "--model", path, "--host", "127.0.0.1", "--port", str(port),
            "--ctx-size", str(args.ctx_size), "--parallel", "1", "--n-predict", str(args.n_predict)]
    return argv + (["--threads", str(args.threads)] if args.threads else []) + args.strata_args.split()


def llama_argv(path: str, port: int, args: argparse.Namespace) -> list[str]:
    return [args.llama_server, "-m", path, "--host", "127.0.0.1", "--port", str(port), "-c", str(args.ctx_size),
            "-np", "1", *(["-t", str(args.threads)] if args.threads else []), "-n", str(args.n_predict), "--jinja",
            "--cache-ram", str(args.llama_cache_ram), "--cache-reuse", str(args.llama_cache_reuse), "--metrics",
            *args.llama_args.split()]

