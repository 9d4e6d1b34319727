"""The real Codex CLI (`@openai/codex` from npm) drives `strata serve` through OpenAI's Responses API: a headless
`codex exec --json` turn and a `codex exec resume --last` turn against the bundled SmolLM2-135M-Instruct (8K
context, one slot) both stream an answer that Codex parses and records, the second turn continues the same thread,
and its request reuses the whole first turn's prompt from the conversation cache: Codex resends its ~6K tokens of
instructions, tools and history every turn, and the server renders that history as an extension of the first
turn's prompt, token for token (with the answer's generated ids, engine/server/answer_ids.py).

Codex sends no max_output_tokens; --n-predict keeps a runaway answer short. Should the model run into it, Codex
reports OpenAI's own cut-off (`response.incomplete`, reason max_output_tokens) as `turn.failed` "Incomplete response
returned, reason: max_output_tokens" and exits 1 after recording the answer: that one error is accepted, any other
fails the test.

Codex is installed by npm into ~/.cache/strata-tests/agents/codex-<version> (once, then reused); the test is
skipped only where node or npm is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from tests.engine_process import EngineProcess, engine_process
from tests.npm_agents import install

pytestmark = pytest.mark.slow

CODEX_VERSION = "0.171.0"  # the version this test was written against; another one installs into its own folder
TURN_TIMEOUT = 420  # one turn: ~6.4K tokens of prefill (~25 s on 2 cores, minutes when they are busy)
N_PREDICT = 256  # the server's cap on each answer
CUT_OFF = "Incomplete response returned, reason: max_output_tokens"  # Codex's words for that cap's end
MIN_REUSE = 0.9


def install_codex(version: str = CODEX_VERSION) -> str:
    """The codex launcher of `@openai/codex@version` (its native binary comes in an optional platform package from
    the same registry), installed once by tests/npm_agents.py."""
    return install("@openai/codex", version, "codex")


def codex_config(base_url: str) -> str:
    """config.toml: the server as a custom Responses provider, no approvals, no update check, no analytics."""
    return f"""\
model = "smollm2"
model_provider = "strata"
model_context_window = 8192
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

# Tools a 135M model cannot use and whose descriptions would not fit its 8K context with the rest.
[features]
multi_agent = false
image_generation = false
skill_search = false
view_image = false
"""


def run_codex(codex: str, args: list[str], home: str, work: str) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "HOME": home, "CODEX_HOME": os.path.join(home, ".codex"), "STRATA_API_KEY": "unused",
           "NO_COLOR": "1"}
    for name in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "CODEX_API_KEY", "RUST_LOG"):
        env.pop(name, None)
    start = time.monotonic()
    done = subprocess.run([codex, *args], cwd=work, env=env, capture_output=True, text=True, timeout=TURN_TIMEOUT,
                          stdin=subprocess.DEVNULL)
    return done, time.monotonic() - start


def turn_events(what: str, done: subprocess.CompletedProcess) -> tuple[str, str]:
    """(thread id, the agent's message) of one `codex exec --json` turn, which must end as turn.completed (exit
    0) or as turn.failed for the --n-predict cut-off alone (exit 1); anything else fails with Codex's output."""
    shown = f"{what}: exit {done.returncode}\n--- stdout ---\n{done.stdout[-6000:]}\n--- stderr ---\n{done.stderr[-3000:]}"
    events = []
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            events.append(json.loads(line))
    kinds = [e["type"] for e in events]
    assert "thread.started" in kinds and "turn.started" in kinds, shown
    messages = [e["item"]["text"] for e in events
                if e["type"] == "item.completed" and e["item"].get("type") == "agent_message"]
    assert messages and messages[-1].strip(), shown
    if kinds[-1] == "turn.completed":
        assert done.returncode == 0, shown
    else:
        assert kinds[-1] == "turn.failed" and done.returncode == 1, shown
        assert events[-1]["error"]["message"] == CUT_OFF, shown
    errors = [e["message"] for e in events if e["type"] == "error"]
    assert set(errors) <= {CUT_OFF}, shown
    return next(e["thread_id"] for e in events if e["type"] == "thread.started"), messages[-1]


def requests_log(engine: EngineProcess) -> list[dict]:
    status, body = engine.get_json("/cache/requests")
    assert status == 200, (status, body)
    return body["requests"]


def main_request(records: list[dict], before: list[dict]) -> dict:
    """The turn's main request: the largest prompt among the requests the turn sent."""
    seen = {r["request_id"] for r in before}
    new = [r for r in records if r["request_id"] not in seen]
    assert new, "Codex sent no request to the server"
    return max(new, key=lambda r: r["prompt_tokens"])


def test_codex_exec_and_resume_reuse_the_first_turn_from_the_cache(tmp_path):
    codex = install_codex()
    home, work = tmp_path / "home", tmp_path / "work"
    (home / ".codex").mkdir(parents=True)
    work.mkdir()
    args = ("--model", "", "--ctx-size", "8192", "--parallel", "1", "--n-predict", str(N_PREDICT))
    with engine_process(*args, timeout=900) as engine:
        (home / ".codex" / "config.toml").write_text(codex_config(engine.base_url))

        before = requests_log(engine)
        first, t1 = run_codex(codex, ["exec", "--json", "--skip-git-repo-check", "--sandbox", "read-only",
                                      "Say hello in one short sentence."], str(home), str(work))
        thread, answer = turn_events("codex exec", first)
        after_first = requests_log(engine)
        one = main_request(after_first, before)

        second, t2 = run_codex(codex, ["exec", "resume", "--json", "--last", "--skip-git-repo-check",
                                       "Now say goodbye in one short sentence."], str(home), str(work))
        resumed, _ = turn_events("codex exec resume --last", second)
        assert resumed == thread, (thread, resumed)
        two = main_request(requests_log(engine), after_first)

        print(f"\ncodex {CODEX_VERSION}: turn 1 {t1:.1f} s (exit {first.returncode}), prompt {one['prompt_tokens']} "
              f"tokens, ttft {one.get('ttft_ms')} ms, answer {answer!r}; turn 2 {t2:.1f} s (exit "
              f"{second.returncode}), prompt {two['prompt_tokens']} tokens, {two['reused_tokens']} reused "
              f"({two['source']}, {two['reason']}, {two['detail']}), ttft {two.get('ttft_ms')} ms")
        assert two["prompt_tokens"] > one["prompt_tokens"], (one, two)
        assert two["reused_tokens"] >= MIN_REUSE * one["prompt_tokens"], (
            f"turn 2 reused {two['reused_tokens']} of turn 1's {one['prompt_tokens']} prompt tokens:\n"
            + json.dumps(two, indent=1))
