"""The expert arena in the cache's accounting, through a real `strata serve` and the openai SDK (seed 000):
the engine reports the arena's resident bytes in /metrics (JSON and Prometheus); on a host whose arena leaves
less free memory than the floor, RAM mode refuses every park (counted, reason "floor") and the conversation
comes back cold, while disk mode keeps parking and restores it on the switch back.

The tiny model's arena is a few hundred KiB, so the host cannot really be filled; the floor is set above the
memory psutil says is available when the test starts, which leaves every RAM park below it, as a real arena of
tens of GiB does on a 64 GiB machine.
"""

from __future__ import annotations

import json
import urllib.request

import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.model import int4
from tests.engine_process import engine_process
from tests.model_fixtures import TINY_SIZES
from tests.moe_fixtures import EXPERT_SIZE, N_EXPERTS, write_tiny_moe_model

pytestmark = [pytest.mark.skipif(not int4.available(), reason="this torch has no CPU int4 kernels"),
              pytest.mark.timeout(300)]
MIB = 1 << 20
WORDS = ("harbour lantern orchard granite velvet compass meadow thunder ribbon saddle quartz ember willow "
         "pebble falcon").split()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return write_tiny_moe_model(tmp_path_factory.mktemp("arena"), "qwen3_moe")


def _text(seed: int, n: int = 40) -> str:  # ~230 tokens of the tiny tokenizer (512-token context)
    return " ".join(WORDS[(seed * 7 + i * (seed + 3)) % len(WORDS)] for i in range(n))


def _get(engine, path: str) -> bytes:
    with urllib.request.urlopen(engine.base_url + path, timeout=30) as response:
        return response.read()


def _alternate(engine) -> tuple[int, int]:
    """A, then B (parks A), then A's next turn: (A's first prompt tokens, tokens served from cache on return)."""
    client = openai.OpenAI(base_url=engine.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def ask(messages):
        return client.chat.completions.create(model="m", messages=messages, max_tokens=4, temperature=0)

    a = [{"role": "user", "content": _text(1)}]
    first = ask(a)
    ask([{"role": "user", "content": _text(2)}])
    a += [{"role": "assistant", "content": first.choices[0].message.content},
          {"role": "user", "content": "and then?"}]
    back = ask(a)
    return first.usage.prompt_tokens, back.usage.prompt_tokens_details.cached_tokens


def _floor_mib() -> int:
    """A floor above what is available now: no RAM park can leave that much free."""
    return psutil.virtual_memory().available // MIB + 4096


def _args(model: str, *more: str) -> tuple[str, ...]:
    # Float weights with every layer's experts on the CPU: the arena is the 4-bit experts.
    return ("--model", model, "--cpu-weights", "float", "--moe-experts", "cpu", "--parallel", "1",
            "--ctx-size", "1024", "--conversation-cache-min-free-mib", str(_floor_mib()), *more)


def test_ram_mode_refuses_parks_under_the_floor_and_reports_the_arena(model):
    with engine_process(*_args(model, "--conversation-cache-storage", "ram")) as engine:
        prompt, cached = _alternate(engine)
        metrics = json.loads(_get(engine, "/metrics"))
        text = _get(engine, "/metrics?format=prometheus").decode()
    cache = metrics["conversation_cache"]
    assert cache["refusals"].get("floor", 0) >= 1, cache["refusals"]
    assert cache["parks"] == 0 and cache["restores"] == 0
    assert cached < prompt // 4, f"A came back with {cached} of {prompt} tokens cached, nothing was parked"

    arena = metrics["engine"]["expert_arena_bytes"]
    float_experts = 2 * N_EXPERTS * 3 * TINY_SIZES["hidden_size"] * EXPERT_SIZE * 4  # 2 expert layers, float32
    assert 0 < arena < float_experts / 5, "the arena is the experts as 4-bit groups"
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["strata_expert_arena_bytes"] == arena


def test_disk_mode_keeps_parking_under_the_same_floor(model, tmp_path):
    with engine_process(*_args(model, "--conversation-cache-storage", "disk",
                               "--conversation-cache-dir", str(tmp_path / "cache"))) as engine:
        prompt, cached = _alternate(engine)
        cache = json.loads(_get(engine, "/metrics"))["conversation_cache"]
    assert "floor" not in cache["refusals"], cache["refusals"]
    assert cache["parks"] >= 1 and cache["restores"] >= 1, cache
    assert cached >= prompt - 1, f"A came back with only {cached} of its {prompt} tokens from disk"
