"""Tiered storage when RAM has no room because what fills it is in use: the park goes to disk, as one RAM refuses
for its size, the host-memory floor or priority does, and the conversation is restored from there."""

from __future__ import annotations

import httpx

from tests.engine_process import engine_process
from tests.model_fixtures import write_tiny_model

TEXT = "The quick brown fox jumps over the lazy dog. " * 40  # ~840 tokens: 0.6 MiB of K/V for the tiny model


def test_a_park_ram_has_no_room_for_goes_to_disk_and_is_restored(tmp_path):
    model = write_tiny_model(tmp_path, "llama", max_position_embeddings=2048)
    # 1 MiB of RAM holds one of these conversations, not two; one slot, so every switch parks the other.
    with engine_process(
        "--model", model, "--ctx-size", "2048", "--parallel", "1", "--conversation-cache-storage", "tiered",
        "--conversation-cache-dir", str(tmp_path / "parked"), "--conversation-cache-mib", "1",
        "--conversation-cache-min-free-mib", "0",
    ) as engine, httpx.Client(base_url=engine.base_url, timeout=60) as http:

        def ask(topic: str) -> dict:
            r = http.post("/v1/completions", json={"prompt": f"{topic}: {TEXT}", "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()["usage"]

        ask("A")
        ask("B")  # parks A in RAM
        # A comes back: its RAM entry is the hit being restored, so it cannot make room for B, which was dropped
        # ("no_room") before; it goes to disk now
        assert ask("A")["prompt_tokens_details"]["cached_tokens"] > 0
        tiers = {row["name"][:1]: row["tier"] for row in http.get("/cache/conversations").json()["conversations"]}
        assert tiers == {"A": "ram", "B": "disk"}
        usage = ask("B")
        assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 2
        cache = http.get("/metrics").json()["conversation_cache"]
        assert cache["refusals"] == {} and cache["restores"] == 2
