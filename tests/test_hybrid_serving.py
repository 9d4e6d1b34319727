"""Hybrid models served by a real `strata serve` through the openai SDK: greedy output equals the model run
alone (its own forward, one prefill then one token at a time), with chunked prefill, two slots decoding at once,
a follow-up turn that reuses its slot's recurrent state, and a conversation that comes back after two others took
both slots: restored from the conversation cache (K/V + recurrent-state checkpoint), listed with its checkpoints,
and counted in /metrics without a single restore that reused nothing."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from tests.engine_process import start_engine
from tests.hybrid_fixtures import write_tiny_hybrid

MAX_TOKENS = 8
SERVED = ("lfm2", "granitemoehybrid", "qwen3_5", "qwen3_next", "qwen3_5_moe", "nemotron_h", "granitemoehybrid_moe",
          "nemotron_h_moe", "falcon_h1")
QUESTIONS = ["the river bends twice before the mill and the old road follows it", "apples ripen late"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hybrid-serve")
    return {arch: write_tiny_hybrid(root, arch) for arch in SERVED}


def _messages(text: str) -> list[dict]:
    return [{"role": "system", "content": "You answer. " * 6}, {"role": "user", "content": text}]


def _alone(folder: str, conversations: list[list[dict]], generated: list[list[int]] = ()) -> tuple[list[str], list]:
    """Greedy answers (texts and ids) of the model run alone (no engine): prefill the whole prompt, then one token
    at a time. Earlier answers in `generated` are in the prompt as the ids generated, as the server sends them."""
    from engine.model import SeqChunk, load_model
    from engine.model.loader import read_model_config
    from engine.server.prompt_tokens import PromptIds
    from engine.server.prompts import render_prompt

    lm = load_model(folder, [(torch.device("cpu"), 0, read_model_config(folder).n_layers)], torch.float32)
    ids = PromptIds()
    for answer in generated:
        ids.answers.remember(lm.tokenizer, answer)
    texts, answers = [], []
    for messages in conversations:
        prompt = render_prompt(lm.tokenizer, messages, None, ids).ids
        kv, state = lm.model.new_buffers(1, 512)
        logits = lm.model.forward_chunks([SeqChunk(0, 0, torch.tensor(prompt))], kv, state)
        tokens, pos = [], len(prompt)
        for _ in range(MAX_TOKENS):
            tokens.append(int(logits[0].argmax()))
            logits = lm.model.forward_chunks([SeqChunk(0, pos, torch.tensor(tokens[-1:]))], kv, state)
            pos += 1
        texts.append(lm.tokenizer.decode(tokens))
        answers.append(tokens)
    return texts, answers


def _ask(client: openai.OpenAI, messages: list[dict]):
    r = client.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=MAX_TOKENS,
                                       extra_body={"ignore_eos": True})
    return r


@pytest.mark.slow
@pytest.mark.parametrize("arch", SERVED)
def test_hybrid_model_served_matches_the_model_alone(folders, arch):
    folder = folders[arch]
    conversations = [_messages(q) for q in QUESTIONS]
    reference, generated = _alone(folder, conversations)
    engine = start_engine("--model", folder, "--ctx-size", "512", "--parallel", "2", "--prefill-chunk", "16",
                          "--cpu-weights", "float", "--threads", "1", "--conversation-cache-min-free-mib", "0")
    try:
        client = openai.OpenAI(base_url=engine.base_url + "/v1", api_key="none", max_retries=0, timeout=120)
        with ThreadPoolExecutor(max_workers=2) as pool:  # both slots prefill and decode in the same steps
            answers = list(pool.map(lambda m: _ask(client, m), conversations))
        texts = [a.choices[0].message.content for a in answers]
        assert texts == reference
        assert all(a.usage.completion_tokens == MAX_TOKENS for a in answers)
        # A follow-up of the first conversation reuses its slot's state: only the new tokens are computed.
        follow = conversations[0] + [{"role": "assistant", "content": texts[0]}, {"role": "user", "content": "more"}]
        again = _ask(client, follow)
        assert again.usage.prompt_tokens_details.cached_tokens > 0
        # The answer sent back is the ids the engine generated for it (engine/server/answer_ids.py).
        follow_texts, follow_ids = _alone(folder, [follow], generated)
        assert again.choices[0].message.content == follow_texts[0]
        # Two other conversations take both slots (parking the first two), then the first comes back.
        others = [_messages(f"{q} and then some other words {i}") for i, q in enumerate(QUESTIONS)]
        with ThreadPoolExecutor(max_workers=2) as pool:
            list(pool.map(lambda m: _ask(client, m), others))
        back = follow + [{"role": "assistant", "content": again.choices[0].message.content},
                         {"role": "user", "content": "and then?"}]
        resumed = _ask(client, back)
        # at least from the previous prompt's end checkpoint (the state before its last token)
        assert resumed.usage.prompt_tokens_details.cached_tokens >= again.usage.prompt_tokens - 1
        assert resumed.choices[0].message.content == _alone(folder, [back], generated + follow_ids)[0][0]
        metrics = httpx.get(engine.base_url + "/metrics", timeout=10).json()
        assert metrics["conversation_cache"]["restores"] >= 1
        assert metrics["engine"]["restores_without_reuse"] == 0
        rows = httpx.get(engine.base_url + "/cache/conversations", timeout=10).json()["conversations"]
        assert rows and all(r["checkpoints"] >= 1 for r in rows)
        text = httpx.get(engine.base_url + "/metrics", params={"format": "prometheus"}, timeout=10).text
        assert "restores_without_reuse" in text
    finally:
        engine.stop()

