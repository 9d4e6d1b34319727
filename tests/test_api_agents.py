"""An agent with subagents and side calls on one engine, through the openai SDK: the parent's every return reuses
nearly all of its prompt (from its live slot or the cache, never from token 0) and answers exactly as the parent
run alone on a fresh engine, on --parallel 1 and 2; and clients hammering shared prefixes from several threads
get, every time, the answer a fresh engine computes from scratch. A tiny random-weight model keeps it fast;
float weights, so two engines that computed the same tokens from different starts agree to float32 precision."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.engine_process import start_engine
from tests.model_fixtures import write_tiny_model

pytestmark = pytest.mark.slow  # four engines start side by side: over 20 s on a busy machine

SYSTEM = "You are a helpful coding assistant. Answer briefly and precisely, and say when you are not sure."
FILLER = "The quick brown fox jumps over the lazy dog. Hello, world! This is a tiny tokenizer for tests. "
PARENT = "Main task: fix the parser in this repository. " + FILLER * 6
SUBAGENTS = ["Subagent one: read the tests. " + FILLER * 3, "Subagent two: read the docs. " + FILLER * 4]
SIDE_CALL = "Give a title for: fix the parser"
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """A fresh reference (one slot, no cache), agents on --parallel 1 and 2, a hammered --parallel 3 whose cache
    holds three conversations (so parks evict), all started side by side."""
    root = tmp_path_factory.mktemp("agents")
    model = write_tiny_model(root, "llama")
    common = ("--model", model, "--ctx-size", "2048", "--cpu-weights", "float",
              "--conversation-cache-min-free-mib", "0")
    flags = {
        "reference": ("--parallel", "1", "--conversation-cache-mib", "0"),
        "p1": ("--parallel", "1", "--conversation-cache-mib", "64"),
        "p2": ("--parallel", "2", "--conversation-cache-mib", "64"),
        "p3": ("--parallel", "3", "--conversation-cache-mib", "1", "--conversation-cache-slots", "3"),
    }
    with ThreadPoolExecutor(max_workers=len(flags)) as pool:
        starting = {name: pool.submit(start_engine, *common, *extra) for name, extra in flags.items()}
        try:
            procs = {name: f.result() for name, f in starting.items()}
        except BaseException:
            for f in starting.values():
                if f.exception() is None:
                    f.result().stop()
            raise
    try:
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


def _client(engine) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client: openai.OpenAI, messages: list[dict], **kw):
    r = client.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=MAX_TOKENS,
                                       extra_body={"ignore_eos": True}, **kw)
    return r.choices[0].message.content, r.usage


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def _run_parent(client, between=lambda turn: None) -> list[tuple[str, object]]:
    """The parent's three turns; `between(turn)` runs the subagents and side calls after turn 1 and 2."""
    agent = {"metadata": {"strata_priority": "high", "strata_client": "agent"}}
    messages = [{"role": "system", "content": SYSTEM}, _user(PARENT)]
    turns = []
    for turn, follow_up in enumerate(("Now spawn the helpers.", "Summarise what they found.", "")):
        answer, usage = _chat(client, messages, **agent)
        turns.append((answer, usage))
        if follow_up:
            between(turn)
            messages += [{"role": "assistant", "content": answer}, _user(follow_up)]
    return turns


@pytest.fixture(scope="module")
def alone(engines) -> list[str]:
    """The parent run alone on a fresh engine: the answers every other run must give."""
    return [answer for answer, _ in _run_parent(_client(engines["reference"]))]


def _subagent(client, text: str, turns: int = 1) -> None:
    messages = [{"role": "system", "content": SYSTEM}, _user(text)]
    for _ in range(turns):
        answer, _ = _chat(client, messages)
        messages += [{"role": "assistant", "content": answer}, _user("Go on.")]


@pytest.mark.parametrize("name", ["p1", "p2"])
def test_the_parent_returns_to_its_cache_and_answers_as_if_alone(engines, alone, name):
    client = _client(engines[name])
    parallel = int(name[1])
    http = httpx.Client(base_url=engines[name].base_url, timeout=30)
    seen = 0

    def spawn(turn: int) -> None:
        nonlocal seen
        if turn == 0:  # two subagents, at once where there are slots for them, then a side call
            with ThreadPoolExecutor(max_workers=parallel) as pool:
                list(pool.map(lambda text: _subagent(client, text, turns=2), SUBAGENTS))
            _chat(client, [{"role": "system", "content": SYSTEM}, _user(SIDE_CALL)],
                  metadata={"strata_priority": "low"})
        else:  # a subagent without the system prompt, a side call sharing only it with the parent, one comes back
            _chat(client, [_user("Subagent three: check the build. " + FILLER * 2)])
            _chat(client, [{"role": "system", "content": SYSTEM}, _user("Name this session in three words.")])
            _subagent(client, SUBAGENTS[0], turns=1)
            seen = len(http.get("/cache/events", params={"limit": 10000}).json()["events"])

    turns = _run_parent(client, spawn)
    assert [answer for answer, _ in turns] == alone
    for _, usage in turns[1:]:
        reused = usage.prompt_tokens_details.cached_tokens
        assert reused >= 0.9 * usage.prompt_tokens, (name, reused, usage.prompt_tokens)
    rows = http.get("/cache/conversations").json()["conversations"]
    parent = {r["id"] for r in rows if r["client"] == "agent"}
    assert parent and all(r["priority"] == "high" for r in rows if r["id"] in parent)
    # the last return: on one slot the parent was parked and comes back from the cache; on two, the side call (which
    # shares the system prompt with the parent's slot only) and the subagent took the cheaper slot, so the parent's
    # own slot was still live
    events = http.get("/cache/events", params={"limit": 10000}).json()["events"][seen:]
    restores = [e for e in events if e["kind"] == "restore" and e["conversation_id"] in parent]
    assert len(restores) == (1 if parallel == 1 else 0), events
    http.close()


def _hammer_prompts() -> list[list[dict]]:
    """Requests that share prefixes in every way: one context with many questions, continuations of it, and
    conversations that share only the system prompt."""
    context = [{"role": "system", "content": SYSTEM}, _user("Shared context. " + FILLER * 3)]
    prompts = [context + [{"role": "assistant", "content": "Understood."}, _user(f"Question {i}: why?")]
               for i in range(4)]
    prompts += [[context[0], _user(f"Other conversation {i}. " + FILLER * (1 + i))] for i in range(3)]
    prompts.append(context)
    return prompts


def test_hammering_shared_prefixes_from_threads_gives_a_fresh_engines_answers(engines, alone):
    prompts = _hammer_prompts()
    reference = engines["reference"]
    ref_client = _client(reference)
    expected = []
    for messages in prompts:  # computed from token 0 every time: the slot is erased before each
        httpx.post(reference.base_url + "/slots/0", params={"action": "erase"}, timeout=30).raise_for_status()
        expected.append(_chat(ref_client, messages)[0])
    client = _client(engines["p3"])
    n_threads, rounds = 4, 3

    def worker(t: int) -> list[tuple[int, str]]:
        order = [(t * 3 + k * 5) % len(prompts) for k in range(rounds * 2)]
        return [(i, _chat(client, prompts[i])[0]) for i in order]

    with ThreadPoolExecutor(max_workers=n_threads) as pool:
        results = [item for part in pool.map(worker, range(n_threads)) for item in part]
    wrong = [(i, got, expected[i]) for i, got in results if got != expected[i]]
    assert not wrong, wrong
    metrics = httpx.get(engines["p3"].base_url + "/metrics", timeout=30).json()["conversation_cache"]
    assert metrics["restores"] > 0 and metrics["evictions"] > 0, "the hammering never went through the cache"
