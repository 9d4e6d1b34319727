"""A chat template that rewrites a conversation's history (drops past reasoning once a later turn arrives, as
Qwen3's and DeepSeek-R1's do) makes the cache's prefix end there whatever the engine does; the request log must say
that it was the template ("template", from token k), not the client, and /metrics count it apart from "diverged"."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.contract import RequestsBody, parse
from tests.engine_process import engine_process

pytestmark = pytest.mark.timeout(300)

# Past reasoning is written only for the last two messages' answers: a later turn drops it (Qwen3 keeps it only
# after the last user message, which the same requests would show, with tool calls in between).
DROPS_PAST_REASONING = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and m.reasoning_content and loop.index0 >= messages | length - 2 %}"
    "<think>{{ m.reasoning_content }}</think>\n{% endif %}{{ m.content }}<|im_end|>\n"
    "{% endfor %}{{ '<|im_start|>assistant\n' }}")  # a literal last line break would be dropped by Jinja
KEEPS_PAST_REASONING = DROPS_PAST_REASONING.replace(" and loop.index0 >= messages | length - 2", "")
REASONING = "The user wants a colour, so I name one and keep it short. " * 4


def _turns(second_answer: str) -> tuple[list[dict], list[dict]]:
    first = [{"role": "user", "content": "Name a colour."},
             {"role": "assistant", "content": "Blue.", "reasoning_content": REASONING},
             {"role": "user", "content": "Another one?"}]
    return first, [*first, {"role": "assistant", "content": second_answer}, {"role": "user", "content": "Thanks."}]


def _tokenizer(template: str):
    from engine.model.gguf_header import read_gguf_header
    from engine.model.loader import embedded_model_path
    from engine.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf_metadata(read_gguf_header(embedded_model_path()).metadata)
    tokenizer.use_chat_template(template)
    return tokenizer


def test_a_template_dropping_past_reasoning_is_found_where_it_drops_it():
    from engine.server.prompt_tokens import PromptIds
    from engine.server.prompts import render_prompt

    first, second = _turns("Green.")
    tokenizer = _tokenizer(DROPS_PAST_REASONING)
    before = render_prompt(tokenizer, first, None, PromptIds())
    after = render_prompt(tokenizer, second, None, PromptIds())
    assert before.rewritten_at is None, "the first turn's history is written as sent"
    assert after.rewritten_at is not None
    shared = next(i for i, (a, b) in enumerate(zip(before.ids, after.ids, strict=False)) if a != b)
    assert abs(after.rewritten_at - shared) <= 2, (after.rewritten_at, shared)
    assert 0 < shared < len(before.ids) - 10, "the rewrite is inside the earlier turn, not at its end"

    appending = _tokenizer(KEEPS_PAST_REASONING)
    assert render_prompt(appending, second, None, PromptIds()).rewritten_at is None
    assert render_prompt(appending, first, None, None).rewritten_at is None, "counting tokens explains nothing"


def _metric(http: httpx.Client, reason: str) -> float:
    text = http.get("/metrics", params={"format": "prometheus"}).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "strata_prefill_reason_total" and sample.labels.get("reason") == reason:
                return sample.value
    raise AssertionError(f"no strata_prefill_reason_total{{reason={reason!r}}}")


@pytest.mark.parametrize("template, reason", [(DROPS_PAST_REASONING, "template"),
                                              (KEEPS_PAST_REASONING, "new_tokens")])
def test_the_request_log_blames_the_template_only_when_it_rewrote_the_history(tmp_path, template, reason):
    path = tmp_path / "chat.jinja"
    path.write_text(template)
    with engine_process("--model", "", "--ctx-size", "1024", "--parallel", "1", "--chat-template", str(path)) as proc, \
            httpx.Client(base_url=proc.base_url, timeout=120) as http:
        first, _ = _turns("")
        r = http.post("/v1/chat/completions", json={"model": "m", "messages": first, "max_tokens": 8,
                                                     "temperature": 0})
        assert r.status_code == 200, r.text
        held = r.json()["usage"]["prompt_tokens"] + r.json()["usage"]["completion_tokens"]  # what the slot holds
        _, second = _turns(r.json()["choices"][0]["message"]["content"])
        r = http.post("/v1/chat/completions", json={"model": "m", "messages": second, "max_tokens": 1})
        assert r.status_code == 200, r.text
        last = parse(RequestsBody, http.get("/cache/requests").json(), "GET /cache/requests").requests[-1]
        assert last.reason == reason, last
        if reason == "template":
            assert last.detail["rewritten_at"] <= last.detail["diverged_at"] + 2
            assert last.source == "live" and 0 < last.reused_tokens < last.prompt_tokens - 20, "reused up to the rewrite"
        else:
            assert last.reused_tokens >= held - 1, "an appending template: the whole first turn reused"
        assert _metric(http, reason) >= 1
