"""Probe 4, kill -9 in tiered mode: conversations take turns on one slot, so each turn parks the last one in RAM
and spills an older one to disk; the engine is SIGKILLed at seeded moments (some as a file is being written),
restarted on the same folder each time. No file under a cache name may be torn (engine/cache/disk_files.py names
them; a write goes to a temp name first, engine/atomic.py), the restart removes the temp files, and greedy
answers after the last restart equal those of the first engine, which started on an empty folder."""

from __future__ import annotations

import json
import os
import random
import threading
import time

from engine.atomic import is_temp_name
from engine.cache.disk_files import BLOCK_RE, CONV_RE
from engine.cache.fileformat import FileFormatError, read_header, read_tensor
from tools.reliability.common import Checks, Options, Result, words
from tools.reliability.engine import Engine

NAME = "kill-9-tiered"
CONVERSATIONS = 4
PROMPT_WORDS = 200  # ~250 tokens: four 64-token blocks of K/V, ~11 MiB for the bundled model
RAM_MIB = 16  # holds one such conversation, so every park spills another to disk
WRITE_WAIT_S = 20.0  # how long a kill waits for a write to catch in the act before it kills anyway


def run(options: Options) -> Result:
    checks = Checks(NAME)
    folder = options.folder("tiered-cache")
    flags = ["--model", "", "--ctx-size", "1024", "--parallel", "1", "--conversation-cache-storage", "tiered",
             "--conversation-cache-mib", str(RAM_MIB), "--conversation-cache-dir", folder,
             "--conversation-cache-min-free-mib", "0", *options.engine_args]
    log = options.folder("logs") + f"/{NAME}.log"
    engines = [Engine.start(flags, log, cwd=options.workdir)]  # the live one last: stopped whatever happens
    try:
        prompts = [f"Conversation {i}. " + words(PROMPT_WORDS, 100 + i) + "\nSum it up." for i in range(CONVERSATIONS)]
        fresh = [answer(engines[-1], prompt)[0] for prompt in prompts]  # an empty folder: computed from scratch
        kills, torn, leftovers = (2 if options.quick else 6), 0, 0
        rng = random.Random(options.seed)
        for i in range(kills):
            torn += kill_during_turns(engines[-1], prompts, folder, rng, during_write=i % 2 == 0)
            checks.expect(all_whole(folder, checks), f"kill {i + 1}: a file under a cache name is torn")
            engines.append(Engine.start(flags, log, cwd=options.workdir))
            leftovers += sum(map(is_temp_name, walk_names(folder)))
        found = len(conversations(engines[-1]))
        replies = [answer(engines[-1], prompt) for prompt in prompts]
        reused = sum(cached > 0 for _, cached in replies)
        same = sum(text == want for (text, _), want in zip(replies, fresh, strict=True))
        checks.note(f"{kills} kills, {torn} while a file was being written; after the last restart: "
                    f"{found} conversations parked, {reused}/{CONVERSATIONS} prompts reused cached tokens, "
                    f"{same}/{CONVERSATIONS} greedy answers equal the fresh engine's")
        checks.expect(leftovers == 0, f"{leftovers} temp files were left after restarts")
        checks.expect(same == CONVERSATIONS, f"answers after the restart differ: {[r[0] for r in replies]} != "
                      f"{fresh}")
        checks.expect(torn > 0, "no kill landed while a file was being written")
    finally:
        engines[-1].terminate()
    return checks.result()


def answer(engine: Engine, prompt: str) -> tuple[str, int]:
    """The greedy answer to a one-message conversation, and the prompt tokens it did not compute."""
    body = json.dumps({"messages": [{"role": "user", "content": prompt}], "max_tokens": 8, "temperature": 0,
                       "seed": 1}).encode()
    reply = engine.post("/v1/chat/completions", body, timeout=300)
    if reply.status != 200:
        raise RuntimeError(f"a greedy answer failed: {reply.status} {reply.body[:300]!r}")
    data = reply.json()
    assert isinstance(data, dict)
    details = data["usage"].get("prompt_tokens_details") or {}
    return data["choices"][0]["message"]["content"], details.get("cached_tokens", 0)


def conversations(engine: Engine) -> list:
    listed = engine.get("/cache/conversations").json()
    assert isinstance(listed, dict)
    return listed["conversations"]


def kill_during_turns(engine: Engine, prompts: list[str], folder: str, rng: random.Random,
                      during_write: bool) -> bool:
    """Keep the conversations taking turns, then SIGKILL: as soon as a temp file shows (`during_write`), else
    after a seeded delay. True when a temp file was there at the kill."""
    stop = threading.Event()

    def turns() -> None:
        i = rng.randrange(len(prompts))
        while not stop.is_set():
            answer_quietly(engine, prompts[i % len(prompts)])
            i += 1

    client = threading.Thread(target=turns, daemon=True)
    client.start()
    deadline = time.monotonic() + (WRITE_WAIT_S if during_write else rng.uniform(1.0, 4.0))
    while time.monotonic() < deadline and not (during_write and writing(folder)):
        time.sleep(0.002)
    caught = writing(folder)
    engine.kill()
    stop.set()
    client.join(60)
    return caught


def answer_quietly(engine: Engine, prompt: str) -> None:
    """A turn whose failure is expected: the engine may be killed under it."""
    body = json.dumps({"messages": [{"role": "user", "content": prompt}], "max_tokens": 2}).encode()
    engine.post("/v1/chat/completions", body, timeout=60)


def walk_names(folder: str) -> list[str]:
    return [name for _, _, names in os.walk(folder) for name in names]


def writing(folder: str) -> bool:
    return any(map(is_temp_name, walk_names(folder)))


def all_whole(folder: str, checks: Checks) -> bool:
    """Every file under a cache name reads back whole: its header parses and each tensor matches its checksum."""
    for parent, _, names in os.walk(folder):
        for name in names:
            if not (BLOCK_RE.match(name) or CONV_RE.match(name)):
                continue
            path = os.path.join(parent, name)
            try:
                with open(path, "rb", buffering=0) as f:
                    header = read_header(f, os.path.getsize(path))
                    for tensor in header.tensors:
                        read_tensor(f, header, tensor)
            except FileFormatError as exc:
                checks.note(f"torn: {name}: {exc}")
                return False
    return True
