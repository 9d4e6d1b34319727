"""`chat_template_kwargs` in a chat completion: variables handed to the model's chat template beside the messages,
as vLLM, SGLang and llama.cpp's server take them (`{"enable_thinking": false}` is what clients send most).

The names the template's call sets itself (the messages, the tools, the generation prompt, the special tokens) and
the template language's own globals are refused: a request cannot replace them. A variable that switches the model's
thinking (`enable_thinking`; DeepSeek-V3.1's `thinking`) wins over what `reasoning_effort` implies, as the more
specific of the two, and the answer is read from where the prompt, rendered with the request's variables, leaves the
model (engine.model.thinking); that variable must be true or false. A string (at any depth) holding a control token's
text is refused, as in a message (engine.server.prompt_tokens): the template would write it into the prompt, where
it would be read as that token and could forge a turn (unless --allow-special-in-content). A harmony model (gpt-oss)
renders its own format, not a template: there the variables are refused by name rather than ignored.
"""

from __future__ import annotations

import json
from typing import Any

from engine.server.errors import ApiError

PARAM = "chat_template_kwargs"
# What engine.model.tokenizer's render_chat and the templates' own conventions set (Hugging Face's apply_chat_template).
RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                      "bos_token", "eos_token", "pad_token", "unk_token", "raise_exception", "strftime_now",
                      "self",  # render_chat's own first parameter
                      # jinja2's own globals, which templates call (`namespace`, `range`)
                      "namespace", "range", "dict", "lipsum", "cycler", "joiner"})
ENABLE = "enable_thinking"  # true or false only, as every template that reads it expects
MAX_BYTES = 16 * 1024  # as JSON: variables steer a template, they are not a second prompt


def template_kwargs(raw: Any, tokenizer: Any, contents_as_text: bool = True) -> dict[str, Any]:
    """The request's template variables for `tokenizer`'s model, checked; {} when it gave none. `contents_as_text`:
    control-token text in a value is refused (the server's --allow-special-in-content turns it off)."""
    harmony = bool(getattr(tokenizer, "harmony", False))
    thinking = getattr(tokenizer, "thinking", None)
    switches = {ENABLE} | ({thinking.switch} if thinking is not None and thinking.switch else set())
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ApiError(400, f"'{PARAM}': expected an object of template variables, got {type(raw).__name__}",
                       param=PARAM)
    if raw and harmony:
        raise ApiError(400, f"'{PARAM}': this model speaks the harmony format, which has no chat template to take "
                       "them; set the reasoning effort with 'reasoning_effort'", param=PARAM)
    for name, value in raw.items():
        if not name.isidentifier():
            raise ApiError(400, f"'{PARAM}': {name!r} is not a template variable name (letters, digits and _, not "
                           "starting with a digit)", param=f"{PARAM}.{name}"[:100])
        if name in RESERVED:
            raise ApiError(400, f"'{PARAM}.{name}': a name the request or the template language sets itself, not "
                           "a variable a request can give",
                           param=f"{PARAM}.{name}")
        if name in switches and not isinstance(value, bool):
            raise ApiError(400, f"'{PARAM}.{name}': expected true or false, got {json.dumps(value)[:60]}",
                           param=f"{PARAM}.{name}")
    if len(json.dumps(raw)) > MAX_BYTES:
        raise ApiError(400, f"'{PARAM}': more than {MAX_BYTES // 1024} KiB of variables", param=PARAM)
    if contents_as_text:
        for name, value in raw.items():
            control = _control_text(tokenizer, value)
            if control is not None:
                raise ApiError(400, f"'{PARAM}.{name}' holds the text of the model's control token {control!r}, "
                               "which the chat template would write as that token; remove it (or start the "
                               "server with --allow-special-in-content)", param=f"{PARAM}.{name}")
    return dict(raw)


def _control_text(tokenizer: Any, value: Any) -> str | None:
    """The first control token's text in a string of `value` (a JSON value: nested lists and objects, their keys
    too), or None."""
    if isinstance(value, str):
        return tokenizer.special_text_in(value)
    children = [*value.keys(), *value.values()] if isinstance(value, dict) else value if isinstance(value, list) else []
    return next((found for child in children if (found := _control_text(tokenizer, child)) is not None), None)
