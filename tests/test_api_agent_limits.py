"""What agents send that a strict server used to refuse: max_tokens far past the context (capped to the
context's end, finish_reason "length"; --max-tokens-policy refuse keeps the 400), a server-wide --n-predict limit,
and a model without a chat template (ChatML, or --chat-template FILE|NAME)."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from tests.engine_process import EngineStartError, engine_process
from tests.model_fixtures import write_tiny_model, write_tokenizer_files

CTX = 256
ASK = [{"role": "user", "content": "Tell me a long story about a dragon."}]


def client_for(engine) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def capped():
    with engine_process("--model", "", "--ctx-size", str(CTX), "--conversation-cache-mib", "0") as proc:
        yield proc


def test_max_tokens_past_the_context_generates_to_its_end(capped):
    r = client_for(capped).chat.completions.create(model="any", messages=ASK, max_tokens=32000, temperature=0,
                                                   extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens + r.usage.completion_tokens in (CTX - 1, CTX)


def test_max_tokens_within_the_context_is_kept(capped):
    r = client_for(capped).chat.completions.create(model="any", messages=ASK, max_tokens=5, temperature=0,
                                                   extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"


def test_refuse_policy_keeps_the_400_with_both_numbers():
    with (engine_process("--model", "", "--ctx-size", str(CTX), "--max-tokens-policy", "refuse") as proc,
          pytest.raises(openai.BadRequestError) as info):
        client_for(proc).chat.completions.create(model="m", messages=ASK, max_tokens=5000)
    message = info.value.body["message"]
    assert info.value.body["param"] == "max_tokens"
    assert "5000" in message and str(CTX) in message and "--max-tokens-policy" in message


def test_n_predict_limits_every_answer():
    with engine_process("--model", "", "--ctx-size", str(CTX), "--n-predict", "3") as proc:
        client = client_for(proc)
        r = client.chat.completions.create(model="m", messages=ASK, max_tokens=50, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
        r = client.chat.completions.create(model="m", messages=ASK, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3


def _untemplated_model(tmp_path: Path) -> str:
    folder = write_tiny_model(tmp_path, "llama", name="no-template", num_hidden_layers=1)
    write_tokenizer_files(folder, chat_template="")
    return folder


def test_a_model_without_a_chat_template_chats_as_chatml(tmp_path):
    folder = _untemplated_model(tmp_path)
    with engine_process("--model", folder, "--ctx-size", str(CTX)) as proc:
        r = client_for(proc).chat.completions.create(model="m", messages=ASK, max_tokens=2)
        assert r.choices[0].message.role == "assistant"
        logs = proc.logs()
    assert "has no chat template: chats are rendered as ChatML" in logs
    assert logs.count("has no chat template") == 1


def test_chat_template_file_replaces_the_models_own(tmp_path):
    folder = _untemplated_model(tmp_path)
    template = tmp_path / "plain.jinja"
    template.write_text("{% if messages %}ab{% endif %}")  # the same two letters whatever was said
    with engine_process("--model", folder, "--ctx-size", str(CTX), "--chat-template", str(template)) as proc:
        client = client_for(proc)
        short = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
        long = client.chat.completions.create(model="m", messages=ASK, max_tokens=1)
    assert short.usage.prompt_tokens == long.usage.prompt_tokens <= 2


@pytest.mark.parametrize("value, words", [("nope-not-a-template", "no such file"),
                                          ("BROKEN", "not a readable Jinja template")])
def test_a_bad_chat_template_stops_the_start_with_the_reason(tmp_path, value, words):
    if value == "BROKEN":
        broken = tmp_path / "broken.jinja"
        broken.write_text("{% for m in messages %}")
        value = str(broken)
    with pytest.raises(EngineStartError) as info, engine_process("--model", "", "--chat-template", value):
        pass
    assert words in str(info.value)


def test_tools_a_template_cannot_show_are_left_out_when_they_would_not_fit(capped):
    # SmolLM2's template has no tools: they are written into its system turn, unless the prompt then overflows.
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "description": "Does a thing. " * 10,
                                               "parameters": {"type": "object"}}} for i in range(6)]
    client = client_for(capped)
    small = client.chat.completions.create(model="m", messages=ASK, max_tokens=2, tools=tools[:1])
    plain = client.chat.completions.create(model="m", messages=ASK, max_tokens=2)
    assert small.usage.prompt_tokens > plain.usage.prompt_tokens + 40, "one tool fits: it is shown"
    many = client.chat.completions.create(model="m", messages=ASK, max_tokens=2, tools=tools)
    assert many.usage.prompt_tokens == plain.usage.prompt_tokens, "six do not: answered without them"
    assert "answering without them" in capped.logs()


def test_a_template_file_is_checked_as_the_engine_renders_and_a_broken_own_one_falls_back_to_chatml(tmp_path):
    from engine.model.chat_templates import CHATML, choose_chat_template

    good = tmp_path / "good.jinja"  # loop controls and the generation tag: the engine's environment has both
    good.write_text("{% for m in messages %}{% if loop.index > 9 %}{% break %}{% endif %}{% generation %}"
                    "{{ m.content }}{% endgeneration %}{% endfor %}", encoding="utf-8")
    assert choose_chat_template(str(good), "", "m")[1] == str(good)
    text, source = choose_chat_template("", "{% if %}", "m")  # the model's own, broken
    assert text == CHATML and "does not compile" in source
