"""A conversation continues exactly where it left off: when a client sends the model's answer back, the prompt holds
the ids the engine generated for it (whose K/V was computed), not the tokenizer's spelling of the same text. With
sampled answers the two differ often (BPE has many spellings of one string), and a switch-back used to recompute
everything from the answer on."""

from __future__ import annotations

import anthropic
import openai
import pytest

from tests.engine_process import engine_process

QUESTIONS = ["Write a short poem about rain in Paris.", "Describe a strange machine in three sentences.",
             "Invent a recipe with unusual spices."]


@pytest.fixture(scope="module")
def engine():
    # One slot: every other conversation's turn parks this one, and its next turn restores it.
    with engine_process("--model", "", "--parallel", "1", "--ctx-size", "2048") as proc:
        yield proc


def _whole_first_turn(usage_prompt: int, usage_completion: int) -> int:
    # The last sampled token was never run through the model: its K/V does not exist yet.
    return usage_prompt + usage_completion - 1


def test_a_chat_switch_back_reuses_the_whole_previous_turn(engine):
    client = openai.OpenAI(base_url=engine.base_url + "/v1", api_key="none", max_retries=0, timeout=120)
    first = {}
    for seed, question in enumerate(QUESTIONS):
        ask = [{"role": "user", "content": question}]
        r = client.chat.completions.create(model="m", messages=ask, max_tokens=48, temperature=1.2, seed=seed)
        first[question] = (ask + [{"role": "assistant", "content": r.choices[0].message.content}], r.usage)
    for question in QUESTIONS:  # each one comes back after the others took the slot
        history, usage = first[question]
        follow = history + [{"role": "user", "content": "Shorter, please."}]
        stream = client.chat.completions.create(model="m", messages=follow, max_tokens=4, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
        [again] = [c.usage for c in stream if c.usage is not None]
        reused = again.prompt_tokens_details.cached_tokens
        assert reused >= _whole_first_turn(usage.prompt_tokens, usage.completion_tokens), (question, usage, again)
        assert reused >= 0.95 * _whole_first_turn(usage.prompt_tokens, usage.completion_tokens)


def test_a_streamed_anthropic_answer_is_reused_as_generated(engine):
    client = anthropic.Anthropic(base_url=engine.base_url, api_key="none", max_retries=0, timeout=120)
    ask = [{"role": "user", "content": QUESTIONS[0] + " In English."}]
    with client.messages.stream(model="m", max_tokens=48, messages=ask, extra_body={"temperature": 1.0}) as s:
        first = s.get_final_message()
    client.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "Something else."}])
    follow = ask + [{"role": "assistant", "content": first.content[0].text},
                    {"role": "user", "content": "Again?"}]
    again = client.messages.create(model="m", max_tokens=2, messages=follow)
    whole = first.usage.input_tokens + first.usage.cache_read_input_tokens + first.usage.output_tokens - 1
    assert again.usage.cache_read_input_tokens >= whole


def test_a_template_that_trims_answers_still_gets_the_generated_ids():
    from engine.model.gguf_header import read_gguf_header
    from engine.model.loader import embedded_model_path
    from engine.model.tokenizer import Tokenizer
    from engine.server.prompt_tokens import PromptIds
    from engine.server.prompts import render_prompt

    tokenizer = Tokenizer.from_gguf_metadata(read_gguf_header(embedded_model_path()).metadata)
    # Gemma's and Llama 3's templates trim every message.
    tokenizer.use_chat_template("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}<|im_end|>\n"
                                "{% endfor %}<|im_start|>assistant\n")
    answer = "Paris is the capital."
    # A spelling the tokenizer would not choose ("Par" + "is"), then a trailing newline token, as sampled.
    generated = tokenizer.encode("Par") + tokenizer.encode("is is the capital.") + tokenizer.encode("\n")
    assert tokenizer.decode(generated) == answer + "\n" and generated[:-1] != tokenizer.encode(answer)
    ids = PromptIds()
    ids.answers.remember(tokenizer, generated)
    messages = [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": answer + "\n"},
                {"role": "user", "content": "Thanks."}]
    prompt = render_prompt(tokenizer, messages, None, ids).ids
    kept = generated[:-1]
    assert any(prompt[i:i + len(kept)] == kept for i in range(len(prompt))), "the answer's ids as generated, trimmed"
    without = render_prompt(tokenizer, messages, None, PromptIds()).ids
    assert not any(without[i:i + len(kept)] == kept for i in range(len(without))), "re-tokenized, it differs"
