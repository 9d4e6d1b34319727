"""Which chat template renders a model's conversations: `--chat-template FILE|NAME`, else the model's own, else
ChatML (what llama.cpp's server and most fine-tunes of base models fall back to)."""

from __future__ import annotations

import logging
import os

from engine.errors import ModelLoadError
from engine.model.tokenizer import TokenizerError, compile_template

log = logging.getLogger("strata.model")

# ChatML as Qwen and SmolLM write it: system / user / assistant / tool turns, tools listed in the system turn as
# Hermes does, tool calls as <tool_call> JSON (engine/server/tool_calls.py parses them back).
CHATML = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}{% if not loop.first %}<|im_start|>system
{{ message.content }}<|im_end|>
{% endif %}
{%- elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

BUILT_IN = {"chatml": CHATML}


def choose_chat_template(setting: str, own: str, model: str) -> tuple[str, str]:
    """(template text, where it came from) for `--chat-template` `setting` and the model's `own` template."""
    if setting:
        if setting.lower() in BUILT_IN:
            return BUILT_IN[setting.lower()], f"built-in {setting.lower()}"
        if not os.path.isfile(setting):
            raise ModelLoadError(f"--chat-template {setting!r}: no such file; expected a Jinja template file or one "
                                 f"of the built-in names: {', '.join(BUILT_IN)}")
        try:
            with open(setting, encoding="utf-8") as f:
                text = f.read()
            compile_template(text)  # as the engine renders it: {% break %} and {% generation %} are fine
        except (OSError, UnicodeDecodeError, TokenizerError) as exc:
            raise ModelLoadError(f"--chat-template {setting}: not a readable Jinja template: {exc}") from None
        return text, setting
    if own:
        try:
            compile_template(own)
        except TokenizerError as exc:  # the model's file: every chat would be refused as the client's fault
            log.warning("%s: its own %s: chats are rendered as ChatML (--chat-template FILE|NAME to choose one)",
                        model, exc)
            return CHATML, "built-in chatml (the model's own does not compile)"
        return own, "the model's own"
    log.warning("%s has no chat template: chats are rendered as ChatML (--chat-template FILE|NAME to choose one)",
                model)
    return CHATML, "built-in chatml (the model has none)"
