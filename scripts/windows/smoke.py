"""The engine's smoke test for scripts/windows-check.sh, run on the Linux side against an engine under wine.

    smoke.py first  BASE_URL CACHE_DIR   chat answered, a conversation parked (tiered), spilled at POST /shutdown
    smoke.py second BASE_URL CACHE_DIR   after a restart: the first conversation restored from disk
    smoke.py answer BASE_URL             one chat answered, then POST /shutdown (the bundle and the installed app)

The engine runs with --parallel 1 and --conversation-cache-storage tiered, so a second conversation takes the only
slot and parks the first in RAM; a clean stop writes RAM's conversations to CACHE_DIR. Standard library only.
Prints a line of JSON per stage; the last line is the summary; exits non-zero on the first thing that is wrong.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request

# Long enough to fill several of the cache's 64-token blocks, so the parked conversation has whole blocks to keep.
SYSTEM = ("You are a helpful assistant for a small bakery. The bakery sells bread, rolls, cakes and pies, opens at "
          "seven in the morning and closes at six in the evening, is closed on Mondays, and takes orders for "
          "birthday cakes three days ahead. Answer briefly and politely, in one sentence, and never invent "
          "prices. " * 3)
FIRST = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "When do you open on Saturday?"}]
OTHER = [{"role": "system", "content": "You answer questions about the weather in one short sentence."},
         {"role": "user", "content": "Is it going to rain in a desert today? " * 12}]


def request(base: str, path: str, body: dict | None = None, timeout: float = 600) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method="GET" if body is None and path != "/shutdown" else "POST",
                                 headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, {"error": e.read().decode(errors="replace")[:500]}


def wait_healthy(base: str, timeout: float = 600) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            if request(base, "/health", timeout=5)[0] == 200:
                return time.monotonic() - start
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f'{{"error": "the engine did not become healthy in {timeout:.0f} s"}}')


def wait_gone(base: str, timeout: float = 120) -> None:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            request(base, "/health", timeout=2)
        except OSError:
            return
        time.sleep(0.5)
    raise SystemExit(f'{{"error": "the engine still answered {timeout:.0f} s after POST /shutdown"}}')


def chat(base: str, messages: list[dict]) -> dict:
    status, body = request(base, "/v1/chat/completions",
                           {"model": "local", "messages": messages, "max_tokens": 16, "temperature": 0})
    if status != 200:
        raise SystemExit(json.dumps({"error": f"chat answered {status}", "body": body}))
    text = body["choices"][0]["message"]["content"]
    if not text.strip():
        raise SystemExit(json.dumps({"error": "empty answer", "body": body}))
    cached = ((body.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"text": text, "prompt_tokens": body["usage"]["prompt_tokens"], "cached_tokens": cached}


def files_under(folder: str) -> int:
    return sum(len(files) for _, _, files in os.walk(folder))


def shutdown(base: str) -> None:
    status, body = request(base, "/shutdown")
    if status != 202:
        raise SystemExit(json.dumps({"error": f"POST /shutdown answered {status}", "body": body}))
    wait_gone(base)


def main(argv: list[str]) -> int:
    stage, base = argv[0], argv[1]
    folder = argv[2] if len(argv) > 2 else ""
    ready = wait_healthy(base)
    print(json.dumps({"healthy_after_s": round(ready, 1)}), flush=True)
    if stage == "answer":
        a = chat(base, FIRST)
        shutdown(base)
        print(json.dumps(a), flush=True)
        print(f"engine ready in {ready:.0f} s, answered {a['text'].strip()[:40]!r}")
        return 0
    state_file = os.path.join(folder, "..", "smoke-first-answer.json")
    if stage == "first":
        a = chat(base, FIRST)
        print(json.dumps(a), flush=True)
        b = chat(base, OTHER)  # takes the only slot: the first conversation is parked
        print(json.dumps(b), flush=True)
        _, metrics = request(base, "/metrics")
        cache = metrics["conversation_cache"]
        print(json.dumps({k: cache.get(k) for k in ("storage", "parks", "bytes_parked")}), flush=True)
        if cache.get("storage") != "tiered" or not cache.get("parks"):
            raise SystemExit(json.dumps({"error": "nothing parked", "cache": cache}))
        shutdown(base)
        spilled = files_under(folder)
        if not spilled:
            raise SystemExit(json.dumps({"error": f"no file in {folder} after POST /shutdown"}))
        with open(state_file, "w", encoding="utf-8") as f:
            json.dump(a, f)
        print(f"ready in {ready:.0f} s, chat answered, {cache['parks']} parked (tiered), "
              f"{spilled} files written at /shutdown")
        return 0
    if stage == "second":
        with open(state_file, encoding="utf-8") as f:
            a = json.load(f)
        again = chat(base, [*FIRST, {"role": "assistant", "content": a["text"]},
                            {"role": "user", "content": "And on Sunday?"}])
        print(json.dumps(again), flush=True)
        _, metrics = request(base, "/metrics")
        cache = metrics["conversation_cache"]
        shutdown(base)
        if again["cached_tokens"] <= 0:
            raise SystemExit(json.dumps({"error": "the first conversation was not restored after the restart",
                                         "cache": cache}))
        print(f"after restart: {again['cached_tokens']} of {again['prompt_tokens']} prompt tokens restored from disk")
        return 0
    raise SystemExit(f"unknown stage {stage}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
