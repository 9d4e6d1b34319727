"""The real Claude Code CLI (`claude`, installed from npm) against a real `strata serve` of the bundled
SmolLM2-135M-Instruct: two headless turns, `claude -p` then `claude -p --continue`, with Claude Code's own system
prompt and four of its tools (Agent, Bash, Read, Edit: ~4-5K tokens, within the model's 8K context), both succeed,
and the second turn's request reuses its first turn's prompt from the slot or the conversation cache instead of
computing it again.

It proves that the Messages API (engine/server/anthropic_*.py) serves what Claude Code sends (its system blocks,
tools, a system message inside `messages`, streaming, x-api-key) in the shape it accepts, and that an agent's
follow-up turn is served from the cache. Greedy answers (temperature 0 through Claude Code's own
CLAUDE_CODE_EXTRA_BODY setting) keep the run the same each time; a newline stop sequence there ends each answer at
its first line, since a 135M model in a coding agent's prompt may otherwise ramble past Claude Code's output limit,
a turn Claude Code fails.

Claude Code is installed with npm into ~/.cache/strata-tests/agents (tests/npm_agents.py; reused when the pinned
version is there); the test is skipped only where node or npm is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.engine_process import engine_process
from tests.npm_agents import install

pytestmark = pytest.mark.slow

CLAUDE_CODE_VERSION = "2.1.197"
API_KEY = "strata-test-key"
TURN_TIMEOUT_S = 900
TOOLS = ("--tools", "Agent,Bash,Read,Edit")  # Claude Code's whole set (~20K tokens) does not fit an 8K context


def install_claude_code() -> Path:
    """The `claude` executable of CLAUDE_CODE_VERSION (installed once, then reused: tests/npm_agents.py)."""
    return Path(install("@anthropic-ai/claude-code", CLAUDE_CODE_VERSION, "claude"))


def claude_env(base_url: str, home: Path) -> dict[str, str]:
    """Claude Code's environment: this server, a key, a throwaway HOME, and nothing sent anywhere else."""
    return {
        "PATH": os.environ.get("PATH", ""), "HOME": str(home), "CLAUDE_CONFIG_DIR": str(home / ".claude"),
        "ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_API_KEY": API_KEY,
        "ANTHROPIC_MODEL": "smollm2", "ANTHROPIC_SMALL_FAST_MODEL": "smollm2",
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": "smollm2",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1",
        # A 135M model in a coding agent's prompt may ramble past the output limit, and Claude Code fails a turn
        # that stops on max_tokens: each answer is its first line (see the module docstring).
        "CLAUDE_CODE_EXTRA_BODY": json.dumps({"temperature": 0, "stop_sequences": ["\n"]}),
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "256",
        # A cold prefill of several thousand tokens on a busy small CPU.
        "API_TIMEOUT_MS": str(TURN_TIMEOUT_S * 1000), "CLAUDE_STREAM_IDLE_TIMEOUT_MS": str(TURN_TIMEOUT_S * 1000),
    }


def run_turn(claude: Path, env: dict[str, str], cwd: Path, *args: str) -> tuple[dict, float]:
    """One headless turn: Claude Code's JSON result and the seconds it took; fails on a non-zero exit."""
    start = time.monotonic()
    done = subprocess.run([str(claude), "-p", *args, "--output-format", "json"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=TURN_TIMEOUT_S, stdin=subprocess.DEVNULL)
    seconds = time.monotonic() - start
    assert done.returncode == 0, f"claude {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return json.loads(done.stdout), seconds


def requests_since(engine, seen: int) -> list[dict]:
    status, body = engine.get_json("/cache/requests")
    assert status == 200, body
    return body["requests"][seen:]


def test_two_claude_code_turns_and_the_second_reads_the_first_from_the_cache(tmp_path):
    claude = install_claude_code()
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    args = ("--model", "", "--ctx-size", "8192", "--parallel", "1")
    with engine_process(*args, api_key=API_KEY, timeout=900) as engine:
        env = claude_env(engine.base_url, home)

        first, first_s = run_turn(claude, env, work, "Say hello.", *TOOLS)
        turn1 = requests_since(engine, 0)
        second, second_s = run_turn(claude, env, work, "Now say goodbye.", "--continue", *TOOLS)
        turn2 = requests_since(engine, len(turn1))
        print(f"\nClaude Code {CLAUDE_CODE_VERSION}: turn 1 {first_s:.1f} s, turn 2 {second_s:.1f} s")
        for record in turn1 + turn2:
            print({k: record[k] for k in ("client", "prompt_tokens", "reused_tokens", "source", "reason",
                                          "ttft_ms")})

        for result in (first, second):
            assert result["is_error"] is False and result["subtype"] == "success", result
            assert result["result"].strip(), result
        assert second["session_id"] == first["session_id"]  # --continue went on with the same conversation
        # Claude Code may send more than its conversation (a title, token counts): the largest prompt is the turn.
        main1 = max(turn1, key=lambda r: r["prompt_tokens"])
        main2 = max(turn2, key=lambda r: r["prompt_tokens"])
        assert all(r["client"].startswith("claude-cli/") for r in (main1, main2)), (main1, main2)
        assert main1["prompt_tokens"] > 2_000, main1  # Claude Code's own system prompt and tools
        assert main2["prompt_tokens"] > main1["prompt_tokens"], (main1, main2)
        assert main2["reused_tokens"] >= 0.9 * main1["prompt_tokens"], (main1, main2)
        # Claude Code saw the reuse too: the usage it reports counts it as read from the cache.
        usage = second["usage"]
        assert usage["cache_read_input_tokens"] >= 0.9 * main1["prompt_tokens"], usage
