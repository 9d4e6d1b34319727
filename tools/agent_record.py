"""Capture a real agent session for tools/agent_api_bench.py (its --record): a `strata serve` and a recording proxy in
front of it, the agent CLI run headless for three turns, every request it forwards saved (see agent_api_bench.py's
docstring)."""

from __future__ import annotations

import argparse
import datetime
import http.client
import http.server
import json
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from tools.agent_servers import TURN_TIMEOUT_S, Child, model_path, strata_argv
from tools.alternating_bench import free_port

AGENTS = Path.home() / ".cache" / "strata-tests" / "agents"
CLAUDE = AGENTS / "node_modules" / ".bin" / "claude"
CODEX = AGENTS / "openai-codex-0.171.0" / "node_modules" / ".bin" / "codex"  # tests/npm_agents.py's folder
HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade",
              "content-length", "host", "accept-encoding"}
SECRET_HEADERS = {"authorization", "proxy-authorization", "x-api-key", "api-key", "cookie", "set-cookie"}

CLAUDE_TURNS = ("Say hello.", "Now say goodbye.", "What is two plus two?")
CODEX_TURNS = ("Say hello in one short sentence.", "Now say goodbye in one short sentence.",
               "What is two plus two? Answer in one short sentence.")


def kept_headers(headers: Any) -> dict[str, str]:
    """The request headers worth replaying: no hop-by-hop header, no key, token, secret or cookie."""
    out = {}
    for name, value in headers.items():
        low = name.lower()
        if low in HOP_BY_HOP or low in SECRET_HEADERS or any(w in low for w in ("key", "token", "secret", "auth")):
            continue
        out[name] = value
    return out


# ---------------------------------------------------------------------------------------------- capture


class Recorder:
    """A reverse proxy on 127.0.0.1 in front of `upstream` that saves every request it forwards, in order."""

    def __init__(self, upstream: str) -> None:
        self.upstream = urlsplit(upstream)
        self.records: list[dict[str, Any]] = []
        self.turn = 0
        self.lock = threading.Lock()
        recorder = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # one request per connection; a streamed body ends when it closes

            def log_message(self, *_: Any) -> None:
                pass

            def forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                data = self.rfile.read(length) if length else b""
                try:
                    body = json.loads(data) if data else None
                except ValueError:
                    body = {"_undecoded_bytes": len(data)}
                conn = http.client.HTTPConnection(recorder.upstream.hostname, recorder.upstream.port,
                                                  timeout=TURN_TIMEOUT_S)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
                conn.request(self.command, self.path, body=data or None, headers=headers)
                resp = conn.getresponse()
                with recorder.lock:
                    recorder.records.append({"turn": recorder.turn, "method": self.command, "path": self.path,
                                             "headers": kept_headers(self.headers), "body": body,
                                             "status": resp.status})
                self.send_response_only(resp.status, resp.reason)
                for name, value in resp.getheaders():
                    if name.lower() not in HOP_BY_HOP:
                        self.send_header(name, value)
                self.send_header("Connection", "close")
                self.end_headers()
                while chunk := resp.read1(65536):
                    self.wfile.write(chunk)
                    self.wfile.flush()
                conn.close()

            do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = do_PATCH = forward  # noqa: N815

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def claude_env(base_url: str, home: Path) -> dict[str, str]:
    """Claude Code's environment, as tests/test_agent_claude_code.py sets it: this server, a throwaway HOME."""
    return {
        "PATH": os.environ.get("PATH", ""), "HOME": str(home), "CLAUDE_CONFIG_DIR": str(home / ".claude"),
        "ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_API_KEY": "strata-bench-key",
        "ANTHROPIC_MODEL": "smollm2", "ANTHROPIC_SMALL_FAST_MODEL": "smollm2",
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": "smollm2",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "CLAUDE_CODE_EXTRA_BODY": json.dumps({"temperature": 0, "stop_sequences": ["\n"]}),
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "256",
        "API_TIMEOUT_MS": str(TURN_TIMEOUT_S * 1000), "CLAUDE_STREAM_IDLE_TIMEOUT_MS": str(TURN_TIMEOUT_S * 1000),
    }


def codex_config(base_url: str, ctx_size: int) -> str:
    """Codex's config.toml, as tests/test_agent_codex.py writes it: the server as a Responses provider."""
    return f"""\
model = "smollm2"
model_provider = "strata"
model_context_window = {ctx_size}
approval_policy = "never"
sandbox_mode = "read-only"
check_for_update_on_startup = false

[model_providers.strata]
name = "Strata"
base_url = "{base_url}/v1"
wire_api = "responses"
env_key = "STRATA_API_KEY"
request_max_retries = 0
stream_max_retries = 0

[analytics]
enabled = false
"""


def agent_turns(agent: str, base_url: str, home: Path, work: Path, ctx_size: int) -> list[tuple[list[str], dict]]:
    """The three headless turns of `agent` against base_url: (argv, env) each."""
    if agent == "claude-code":
        env = claude_env(base_url, home)
        tools = ["--tools", "Agent,Bash,Read,Edit", "--output-format", "json"]
        return [([str(CLAUDE), "-p", prompt, *([] if i == 0 else ["--continue"]), *tools], env)
                for i, prompt in enumerate(CLAUDE_TURNS)]
    (home / ".codex").mkdir(parents=True, exist_ok=True)
    (home / ".codex" / "config.toml").write_text(codex_config(base_url, ctx_size))
    env = {**os.environ, "HOME": str(home), "CODEX_HOME": str(home / ".codex"), "STRATA_API_KEY": "unused",
           "NO_COLOR": "1"}
    for name in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "CODEX_API_KEY", "RUST_LOG"):
        env.pop(name, None)
    first = [str(CODEX), "exec", "--json", "--skip-git-repo-check", "--sandbox", "read-only"]
    resume = [str(CODEX), "exec", "resume", "--json", "--last", "--skip-git-repo-check"]
    return [([*(first if i == 0 else resume), prompt], env) for i, prompt in enumerate(CODEX_TURNS)]


def agent_version(agent: str) -> str:
    exe = CLAUDE if agent == "claude-code" else CODEX
    done = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)
    return done.stdout.strip()


def record(args: argparse.Namespace) -> int:
    exe = CLAUDE if args.agent == "claude-code" else CODEX
    if not exe.exists():
        print(f"{exe} is missing: install it as tests/test_agent_{args.agent.replace('-', '_')}.py does")
        return 2
    path = model_path(args.model)
    version = agent_version(args.agent)
    port = free_port()
    argv = strata_argv(path, port, args)
    print(" ".join(argv), flush=True)
    server = Child(argv)
    recorder = None
    try:
        server.wait_ready(port, timeout=600)
        recorder = Recorder(server.base)
        with tempfile.TemporaryDirectory(prefix="agent-api-bench-") as tmp:
            home, work = Path(tmp) / "home", Path(tmp) / "work"
            home.mkdir()
            work.mkdir()
            for i, (argv_turn, env) in enumerate(agent_turns(args.agent, recorder.base, home, work, args.ctx_size)):
                recorder.turn = i + 1
                t0 = time.monotonic()
                done = subprocess.run(argv_turn, cwd=work, env=env, capture_output=True, text=True,
                                      timeout=TURN_TIMEOUT_S, stdin=subprocess.DEVNULL)
                print(f"turn {i + 1}: exit {done.returncode} in {time.monotonic() - t0:.1f} s, "
                      f"{sum(r['turn'] == i + 1 for r in recorder.records)} request(s); "
                      f"{done.stdout.strip()[-300:]!r}", flush=True)
                if done.returncode not in (0, 1):  # Codex exits 1 when an answer meets --n-predict
                    print(done.stderr[-3000:])
                    return 1
        records = list(recorder.records)
    finally:
        if recorder is not None:
            recorder.close()
        server.stop()
    header = {"session": {"agent": args.agent, "version": version, "recorded": datetime.date.today().isoformat(),
                          "model": os.path.basename(path), "ctx_size": args.ctx_size, "n_predict": args.n_predict,
                          "turns": list(CLAUDE_TURNS if args.agent == "claude-code" else CODEX_TURNS)}}
    os.makedirs(os.path.dirname(os.path.abspath(args.record)), exist_ok=True)
    with open(args.record, "w") as f:
        for line in (header, *records):
            f.write(json.dumps(line, separators=(",", ":")) + "\n")
    print(f"{len(records)} request(s) saved to {args.record} ({os.path.getsize(args.record) / 1024:.0f} KiB): "
          + ", ".join(f"{r['turn']}:{r['method']} {r['path']} {r['status']}" for r in records))
    return 0


# ---------------------------------------------------------------------------------------------- replay

