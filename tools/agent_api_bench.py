"""Real agent sessions replayed through each API, Strata beside llama-server: per turn, the time to first token and
the prompt tokens recomputed (not read from a cache).

    # replay (default): every session file, a fresh `strata serve` and a fresh llama-server for each
    LLAMA_SERVER=/tmp/llama/bin/llama-server python tools/agent_api_bench.py [--switch] [--threads 2]
        [--sessions tools/agent_sessions/claude_code.jsonl,tools/agent_sessions/codex.jsonl] [--json OUT]

    # capture: a real agent CLI, three turns, through a recording proxy in front of `strata serve`
    python tools/agent_api_bench.py --record tools/agent_sessions/claude_code.jsonl --agent claude-code
    python tools/agent_api_bench.py --record tools/agent_sessions/codex.jsonl --agent codex

Capture (--record): a `strata serve` of the GGUF file (--ctx-size, one slot, --n-predict) and a small reverse
proxy on 127.0.0.1 in front of it that saves every request it forwards, in order: method, path, the headers that
matter (no API key, authorization, cookie or anything named like a key or token; no hop-by-hop headers) and the
JSON body, with the agent's turn it belongs to. The agent runs headless against the proxy, as
tests/test_agent_claude_code.py and tests/test_agent_codex.py run it: Claude Code (`claude -p`, then
`claude -p --continue` twice; `--tools Agent,Bash,Read,Edit` to fit an 8K context; greedy, each answer its first
line, through CLAUDE_CODE_EXTRA_BODY) speaks Anthropic's Messages API; Codex (`codex exec`, then
`codex exec resume --last` twice) speaks OpenAI's Responses API. The file's first line describes the session.

Replay (default): for each session file, a fresh `strata serve` (its conversation cache on, as it ships) and then a
fresh llama-server (LLAMA_SERVER or --llama-server; skipped with a message when unset or missing) on the same GGUF
file, the same --ctx-size, one slot, the same threads; llama-server with its prompt cache in RAM (`--cache-ram`,
idle slots saved to it on a new task) and `--cache-reuse` (chunks reused by KV shifting), and `--metrics`. Each
server gets one tiny warm-up request (not counted); then every generation request of the session is sent as
recorded (the same bodies to both servers: the history holds the answers Strata gave while it was recorded), with
stream on, one after another. Per request:

- TTFT: request sent -> the first content delta (Anthropic `content_block_delta`, Responses `response.*.delta`,
  chat `delta.content`/`tool_calls`), on the client side; the events a server sends before (Strata's message_start
  and pings during a long prefill) do not count.
- prompt tokens and recomputed tokens: Strata from its usage (Messages: `input_tokens` + `cache_read_input_tokens`,
  of which `input_tokens` were computed; Responses: `input_tokens` less `input_tokens_details.cached_tokens`),
  checked against its own log of the request (GET /cache/requests: reused tokens, from where, why); llama-server
  from its `/metrics` counters read before and after each request (`llamacpp:prompt_tokens_total`: the prompt
  tokens it evaluated; `prompt_tokens_cached_total`: those it took from a slot or its prompt cache), which count the
  same in every API; its own usage and `timings.prompt_n` are kept in --json.

With --switch a different short conversation (chat completions, a few hundred tokens, 8 tokens of answer) is sent
before each of the agent's turns after the first, as a subagent or a second conversation takes the one slot
between an agent's turns: the next turn must come back from the cache (Strata parks and restores it;
llama-server saves the idle slot to its prompt cache and loads it back). Those requests are not in the table.

The table: one row per replayed request (turn.request), prompt tokens as each server renders them, tokens recomputed
and TTFT on each side, and Strata's TTFT over llama-server's; totals at the end (requests that failed on either
side are shown with their HTTP status and left out of them), then each side's first-turn prefill rate.

Reading it: the two servers render the same body into prompts of their own. llama-server b11434 drops every tool
definition when the model's chat template has no tool support (the bundled SmolLM2's: "supports_tools: false" in
its log, and "unsupported Responses tool type 'namespace' skipped"), where Strata renders the function tools into
the prompt, so a first turn's TTFT compares prompts of different lengths; the prefill rates compare the work.
Requests Claude Code sends that generate nothing (`HEAD /`) are recorded but not replayed. Strata caps --ctx-size at
the model's trained context (8192 for SmolLM2), and refuses a longer prompt with a 400, which the table shows.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import http.server
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tools.agent_record import record  # noqa: E402
from tools.agent_servers import (  # noqa: E402
    DEFAULT_SESSIONS,
    GENERATION_PATHS,
    TURN_TIMEOUT_S,
    Child,
    llama_argv,
    load,
    model_path,
    strata_argv,
)
from tools.alternating_bench import filler, free_port  # noqa: E402


def read_session(path: Path) -> tuple[dict, list[dict]]:
    """(the session's description, its generation requests in order)."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    head = lines[0]["session"] if lines and "session" in lines[0] else {}
    requests = [r for r in lines if "method" in r and r["method"] == "POST"
                and urlsplit(r["path"]).path in GENERATION_PATHS and isinstance(r.get("body"), dict)]
    return head, requests


def api_of(path: str) -> str:
    return {"/v1/messages": "messages", "/v1/responses": "responses"}.get(urlsplit(path).path, "chat")


def prepared(record: dict, max_tokens: int) -> dict:
    body = dict(record["body"])
    body["stream"] = True
    api = api_of(record["path"])
    if api == "chat":
        body["stream_options"] = {"include_usage": True}
    if max_tokens:
        key = {"messages": "max_tokens", "responses": "max_output_tokens"}.get(api, "max_tokens")
        body[key] = min(int(body.get(key) or max_tokens), max_tokens)
    return body


def is_content(api: str, event: dict) -> bool:
    """Whether an SSE event carries the answer's first content (text, a tool call, reasoning)."""
    if api == "messages":
        return event.get("type") == "content_block_delta"
    if api == "responses":
        return str(event.get("type", "")).endswith(".delta")
    for choice in event.get("choices") or []:
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content"):
            return True
    return False


def usage_of(api: str, event: dict, usage: dict) -> None:
    """Fold one event's usage (and llama-server's timings) into `usage`."""
    if api == "messages":
        got = event.get("usage") or (event.get("message") or {}).get("usage")
        if got:
            usage.update({k: v for k, v in got.items() if v is not None})
    elif api == "responses":
        if event.get("type") in ("response.completed", "response.incomplete", "response.failed"):
            usage.update((event.get("response") or {}).get("usage") or {})
    elif event.get("usage"):
        usage.update(event["usage"])
    if isinstance(event.get("timings"), dict):
        usage["timings"] = event["timings"]


def prompt_and_cached(api: str, usage: dict) -> tuple[int | None, int | None]:
    """(prompt tokens, tokens read from a cache) from an API's usage."""
    if api == "messages":
        if "input_tokens" not in usage:
            return None, None
        cached = int(usage.get("cache_read_input_tokens") or 0)
        return int(usage["input_tokens"]) + cached + int(usage.get("cache_creation_input_tokens") or 0), cached
    if api == "responses":
        if "input_tokens" not in usage:
            return None, None
        return int(usage["input_tokens"]), int((usage.get("input_tokens_details") or {}).get("cached_tokens") or 0)
    if "prompt_tokens" not in usage:
        return None, None
    return int(usage["prompt_tokens"]), int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def stream(base: str, path: str, headers: dict, body: dict) -> dict:
    """One streamed request: ttft_s (to the first content delta), total_s, usage, status, text of an error."""
    api = api_of(path)
    url = urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=TURN_TIMEOUT_S)
    data = json.dumps(body).encode()
    hdrs = {**headers, "Content-Type": "application/json", "Accept": "text/event-stream"}
    t0 = time.perf_counter()
    conn.request("POST", path, body=data, headers=hdrs)
    resp = conn.getresponse()
    out: dict[str, Any] = {"status": resp.status, "ttft_s": None, "usage": {}, "events": 0, "prompt": None,
                           "cached": None}
    if resp.status != 200:
        out["error"] = resp.read().decode(errors="replace")[:500]
        out["total_s"] = time.perf_counter() - t0
        conn.close()
        return out
    for raw in resp:
        line = raw.decode(errors="replace").strip()
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            break
        try:
            event = json.loads(payload)
        except ValueError:
            continue
        out["events"] += 1
        if out["ttft_s"] is None and is_content(api, event):
            out["ttft_s"] = time.perf_counter() - t0
        if event.get("type") in ("error", "response.failed") or "error" in event:
            out["error"] = json.dumps(event)[:500]
        usage_of(api, event, out["usage"])
    out["total_s"] = time.perf_counter() - t0
    conn.close()
    out["prompt"], out["cached"] = prompt_and_cached(api, out["usage"])
    return out


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def llama_counters(base: str) -> dict[str, float]:
    """llama-server's /metrics counters (Prometheus text)."""
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("llamacpp:"):
            name, _, value = line.partition(" ")
            with contextlib.suppress(ValueError):
                out[name.removeprefix("llamacpp:")] = float(value)
    return out


def switch_body(i: int) -> dict:
    """A different short conversation (chat completions) that takes the slot between an agent's turns."""
    return {"model": "any", "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": f"You are helper number {i}. Notes: " + filler(160, 100 + i)},
                         {"role": "user", "content": "Summarise the notes in one sentence."}]}


def replay_on(side: str, base: str, requests: list[dict], args: argparse.Namespace) -> list[dict]:
    """Every request of a session, in order, against one server; a row of figures per request."""
    warm = stream(base, "/v1/chat/completions", {}, {"model": "any", "max_tokens": 1, "stream": True,
                                                      "messages": [{"role": "user", "content": "Hi."}]})
    if warm["status"] != 200:
        raise RuntimeError(f"{side}: warm-up request failed: {warm}")
    rows, last_turn, switches = [], None, 0
    for n, rec in enumerate(requests):
        if args.switch and last_turn is not None and rec["turn"] != last_turn:
            switches += 1
            s = stream(base, "/v1/chat/completions", {}, switch_body(switches))
            if s["status"] != 200:
                raise RuntimeError(f"{side}: switch request failed: {s}")
            print(f"  {side} switch {switches}: ttft {ms(s['ttft_s'])} ms, prompt {s['prompt']}, cached {s['cached']}",
                  flush=True)
        last_turn = rec["turn"]
        before = llama_counters(base) if side == "llama" else None
        row = stream(base, rec["path"], rec.get("headers") or {}, prepared(rec, args.max_tokens))
        row.update(turn=rec["turn"], index=n, path=rec["path"])
        if row["status"] != 200:
            row["prompt_tokens"] = row["computed"] = None
        elif side == "llama" and before is not None:
            after = llama_counters(base)
            row["computed_metrics"] = int(after.get("prompt_tokens_total", 0) - before.get("prompt_tokens_total", 0))
            row["cached_metrics"] = int(after.get("prompt_tokens_cached_total", 0)
                                        - before.get("prompt_tokens_cached_total", 0))
            row["computed"] = row["computed_metrics"]
            row["prompt_tokens"] = row["computed_metrics"] + row["cached_metrics"]
        else:
            log = get_json(base + "/cache/requests?limit=1")["requests"]
            row["explained"] = {k: log[-1].get(k) for k in ("prompt_tokens", "reused_tokens", "source", "reason",
                                                            "ttft_ms")} if log else {}
            if row["prompt"] is not None:
                row["prompt_tokens"], row["computed"] = row["prompt"], row["prompt"] - (row["cached"] or 0)
            else:
                row["prompt_tokens"] = row["explained"].get("prompt_tokens")
                row["computed"] = (row["prompt_tokens"] or 0) - (row["explained"].get("reused_tokens") or 0)
        status = f"HTTP {row['status']}" + (f" {row['error'][:200]}" if row.get("error") else "")
        ttft = f"{row['ttft_s'] * 1000:.0f} ms" if row["ttft_s"] is not None else "no content"
        more = (f", API usage prompt {row['prompt']} cached {row['cached']}, timings "
                f"{({k: row['usage'].get('timings', {}).get(k) for k in ('prompt_n', 'cache_n')})}"
                if side == "llama" else f", {row.get('explained')}")
        print(f"  {side} {label(requests, n)}: {status}, ttft {ttft}, total {row['total_s']:.2f} s, prompt "
              f"{row['prompt_tokens']}, recomputed {row['computed']}{more}", flush=True)
        rows.append(row)
    return rows


def run_server(side: str, argv_for, path_requests: list[dict], args: argparse.Namespace) -> tuple[list[dict], float]:
    port = free_port()
    argv = argv_for(port)
    print(f"# {side}: {' '.join(argv)}", flush=True)
    server = Child(argv)
    try:
        server.wait_ready(port, timeout=600)
        t0 = time.perf_counter()
        rows = replay_on(side, server.base, path_requests, args)
        return rows, time.perf_counter() - t0
    finally:
        server.stop()


def label(requests: list[dict], i: int) -> str:
    """turn.request within the turn (1-based)."""
    turn = requests[i]["turn"]
    k = sum(r["turn"] == turn for r in requests[:i + 1])
    return f"{turn}.{k}"


def ms(seconds: float | None) -> str:
    return f"{seconds * 1000:.0f}" if seconds is not None else "–"


def cell(row: dict | None, key: str) -> str:
    """A figure of a row for the table: '–' without a row, the HTTP status where the request failed."""
    if row is None:
        return "–"
    if row["status"] != 200:
        return f"HTTP {row['status']}"
    value = row[key]
    return ms(value) if key == "ttft_s" else str(value)


def table(name: str, requests: list[dict], ours: list[dict], theirs: list[dict] | None) -> None:
    print(f"\n{name}\n")
    print("| turn | API | prompt tokens (strata / llama) | recomputed strata | recomputed llama | TTFT strata ms | "
          "TTFT llama ms | strata / llama |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    tot = {"sp": 0, "lp": 0, "sc": 0, "lc": 0, "st": 0.0, "lt": 0.0}
    left_out = 0
    for i, row in enumerate(ours):
        other = theirs[i] if theirs else None
        both = row["status"] == 200 and (other is None or other["status"] == 200)
        ratio = (f"{row['ttft_s'] / other['ttft_s']:.2f}x" if both and other and row["ttft_s"] and other["ttft_s"]
                 else "–")
        print(f"| {label(requests, i)} | {urlsplit(row['path']).path} | {cell(row, 'prompt_tokens')} / "
              f"{cell(other, 'prompt_tokens')} | {cell(row, 'computed')} | {cell(other, 'computed')} "
              f"| {cell(row, 'ttft_s')} | {cell(other, 'ttft_s')} | {ratio} |")
        if not both:
            left_out += 1
            continue
        tot["sp"] += row["prompt_tokens"] or 0
        tot["sc"] += row["computed"] or 0
        tot["st"] += row["ttft_s"] or row["total_s"]
        if other:
            tot["lp"] += other["prompt_tokens"] or 0
            tot["lc"] += other["computed"] or 0
            tot["lt"] += other["ttft_s"] or other["total_s"]
    what = f"**total**{f' ({left_out} failed left out)' if left_out else ''}"
    if theirs and tot["lt"]:
        print(f"| {what} | | {tot['sp']} / {tot['lp']} | {tot['sc']} | {tot['lc']} | {tot['st'] * 1000:.0f} | "
              f"{tot['lt'] * 1000:.0f} | {tot['st'] / tot['lt']:.2f}x |")
    else:
        print(f"| {what} | | {tot['sp']} / – | {tot['sc']} | – | {tot['st'] * 1000:.0f} | – | – |")
    # The two servers may render the same body into prompts of different lengths (a chat template without tools
    # drops the tool definitions): the first turn's prefill rate compares the work itself.
    rates = [f"{side} {r['computed']} tokens in {r['ttft_s']:.2f} s ({r['computed'] / r['ttft_s']:.0f} tok/s)"
             for side, r in (("strata", ours[0]), ("llama-server", theirs[0] if theirs else None))
             if r and r["status"] == 200 and r["ttft_s"] and r["computed"]]
    if rates:
        print(f"\nturn 1 prefill to the first token: {'; '.join(rates)}")
    for side, rows in (("strata", ours), ("llama-server", theirs or [])):
        for i, r in enumerate(rows):
            if r["status"] != 200 or r.get("error"):
                print(f"{side} {label(requests, i)}: HTTP {r['status']} {r.get('error', '')[:300]}")


def replay(args: argparse.Namespace) -> int:
    from tools.llama_cpp_compare import cpu_description

    path = model_path(args.model)
    files = [Path(p) for p in args.sessions.split(",")] if args.sessions else list(DEFAULT_SESSIONS)
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        print(f"no session file {', '.join(missing)}: record one with --record FILE --agent ...")
        return 2
    llama = args.llama_server
    if llama and not (os.path.isfile(llama) and os.access(llama, os.X_OK)):
        llama = shutil.which(llama) or ""
        if not llama:
            print(f"# llama-server {args.llama_server!r} not found: Strata's figures only")
    elif not llama:
        print("# LLAMA_SERVER unset (or --llama-server): Strata's figures only")
    args.llama_server = llama
    print(f"# {cpu_description()}")
    print(f"# {os.path.basename(path)}, ctx {args.ctx_size}, one slot, threads {args.threads or 'defaults'}, "
          f"switch {'on' if args.switch else 'off'}, load {load()}", flush=True)
    if llama:
        version = subprocess.run([llama, "--version"], capture_output=True, text=True, timeout=60)
        print(f"# llama-server: {(version.stdout + version.stderr).strip().splitlines()[0]}", flush=True)
    results: dict[str, Any] = {"args": vars(args), "sessions": {}}
    started = time.perf_counter()
    for file in files:
        head, requests = read_session(file)
        name = (f"{file.name}: {head.get('agent', '?')} {head.get('version', '')}, {len(requests)} requests over "
                f"{len({r['turn'] for r in requests})} turns" + (", a different conversation between turns"
                                                                if args.switch else ""))
        print(f"\n## {name}", flush=True)
        ours, ours_s = run_server("strata", lambda p: strata_argv(path, p, args), requests, args)
        theirs = theirs_s = None
        if llama:
            theirs, theirs_s = run_server("llama", lambda p: llama_argv(path, p, args), requests, args)
        print(f"# replayed in {ours_s:.0f} s (strata)" + (f", {theirs_s:.0f} s (llama-server)" if theirs_s else "")
              + f", load {load()}", flush=True)
        table(name, requests, ours, theirs)
        results["sessions"][file.name] = {"session": head, "strata": ours, "llama": theirs}
    print(f"\n# {time.perf_counter() - started:.0f} s in all, load average at the end {load()} on "
          f"{os.cpu_count()} CPUs")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--record", metavar="OUT.jsonl", help="capture a session of --agent into this file")
    parser.add_argument("--agent", choices=("claude-code", "codex"), default="claude-code",
                        help="the agent CLI --record runs")
    parser.add_argument("--sessions", default="", help="comma-separated session files to replay (default: "
                        + ", ".join(str(p.relative_to(REPO)) for p in DEFAULT_SESSIONS) + ")")
    parser.add_argument("--switch", action="store_true",
                        help="a different short conversation takes the slot before each agent turn after the first")
    parser.add_argument("--model", default="", help="GGUF file (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--ctx-size", type=int, default=8192, help="both servers' context (one slot)")
    parser.add_argument("--threads", type=int, default=2, help="both servers' threads (0: each side's defaults)")
    parser.add_argument("--n-predict", type=int, default=256,
                        help="both servers' cap on an answer (Codex sends none): strata --n-predict, llama-server -n")
    parser.add_argument("--max-tokens", type=int, default=0,
                        help="cap each replayed request's max tokens at this (0: as recorded)")
    parser.add_argument("--strata-args", default="", help="more `strata serve` flags")
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER", ""))
    parser.add_argument("--llama-cache-ram", type=int, default=4096, help="llama-server --cache-ram (MiB)")
    parser.add_argument("--llama-cache-reuse", type=int, default=256, help="llama-server --cache-reuse")
    parser.add_argument("--llama-args", default="", help="more llama-server flags")
    parser.add_argument("--json", help="also write every figure here")
    args = parser.parse_args(argv)
    return record(args) if args.record else replay(args)


if __name__ == "__main__":
    sys.exit(main())
