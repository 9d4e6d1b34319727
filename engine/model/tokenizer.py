"""Tokenizer, chat template and streaming detokenizer, built from tokenizer.json or from GGUF metadata."""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import xxhash
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken
from tokenizers import Tokenizer as FastTokenizer

from engine.model.gguf_vocab import byte_level_bpe, sentencepiece_bpe
from engine.model.template_arguments import with_joinable_arguments
from engine.model.thinking import MARKER_TOKENS as THINKING_MARKERS
from engine.model.thinking import Thinking, detect_thinking

# Tokens that end a turn in common chat formats; generation stops on them as on eos.
END_OF_TURN_TOKENS = (
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|endoftext|>", "<end_of_turn>", "<|end|>",
    "<turn|>",  # Gemma 4
)
# gpt-oss's harmony format: a chat whose tokenizer has all of these is written and read as harmony (engine.server.harmony)
HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")
# Gemma 4's markers of a call and of its strings: special tokens in its tokenizer.json, decoded as text here (as
# llama.cpp's converter makes them user-defined tokens) so the tool-call parser reads them.
# DeepSeek-V3's call markers (engine.server.deepseek_calls) likewise, in whichever tokenizer.json marks them special,
# and the markers of a thought (engine.model.thinking: `<think>`, Gemma 4's channel), which the server splits out.
# What a GGUF's tokenizer is built into (Tokenizer._gguf_backend, which control tokens stay special, and
# engine/model/gguf_vocab.py's backends and pre-tokenizer splits): kept built tokenizers (engine/model/weights_cache.py
# KeptTokenizer) carry it in their key, so bump it with any change there, or an engine keeps using what an older one
# built (2: DeepSeek's tool-call markers no longer special).
GGUF_TOKENIZER_BUILD = 2
RENDERED_MARKERS = frozenset({
    "<|tool_call>", "<tool_call|>", '<|"|>',
    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
}) | THINKING_MARKERS

_CONTROL, _USER_DEFINED = 3, 4  # GGUF token types


class TokenizerError(ValueError):
    """The tokenizer files are missing or malformed; the message says which and why."""


class Tokenizer:
    """Text <-> token ids, chat rendering, and incremental decoding for one model."""

    def __init__(
        self,
        backend: FastTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Iterable[int],
        chat_template: str,
        fingerprint: str,
        add_bos: bool,
        special_tokens: dict[str, str] | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = frozenset(int(i) for i in eos_token_ids)
        self.chat_template = chat_template
        self.fingerprint = fingerprint
        self.add_bos = add_bos
        self.special_tokens = dict(special_tokens or {})
        harmony = {t: i for t in HARMONY_TOKENS if (i := backend.token_to_id(t)) is not None}
        self.harmony = len(harmony) == len(HARMONY_TOKENS)
        if self.harmony:
            # <|end|> ends one message and the model goes on (its answer follows its analysis): the answer ends with
            # <|return|>, a tool call with <|call|> (llama.cpp reads gpt-oss's end-of-generation tokens so too)
            self.eos_token_ids = (self.eos_token_ids - {harmony["<|end|>"]}) | {harmony["<|return|>"], harmony["<|call|>"]}
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.base_vocab_size = backend.get_vocab_size(with_added_tokens=False)  # without added (control) tokens
        self._template: jinja2.Template | None = None
        self._text_backend: FastTokenizer | None = None  # encode_text's copy, built on first use
        self._text_lock = threading.Lock()
        # The text of every special (control) token, longest first: what user text must not turn into.
        specials = sorted({t.content for t in backend.get_added_tokens_decoder().values() if t.special and t.content},
                          key=len, reverse=True)
        self._special_text = re.compile("|".join(map(re.escape, specials))) if specials else None
        self.max_prompt_chars: int | None = None  # set by limit_prompts
        self.context_tokens: int | None = None  # set by limit_prompts
        self.thinking: Thinking | None = detect_thinking(self)


    def vocabulary(self) -> dict[str, int]:
        """Every token's text and id, added tokens included (a draft model's must be the model's own)."""
        return self.backend.get_vocab(with_added_tokens=True)
    def limit_prompts(self, context_tokens: int) -> None:
        """Text longer than this many characters cannot fit `context_tokens` tokens: no token covers more
        characters than the vocabulary's longest (a byte-level token's string has one character per byte, and a
        character is at least one byte). Prompts are checked against it before they are tokenized, so a huge one
        costs neither the memory nor the seconds of tokenizing it."""
        self.context_tokens = context_tokens
        longest = max((len(t) for t in self.backend.get_vocab(with_added_tokens=True)), default=1)
        self.max_prompt_chars = context_tokens * max(longest, 1)

    # -- construction

    @classmethod
    def from_hf_folder(cls, folder: str) -> Tokenizer:
        """From tokenizer.json + tokenizer_config.json (+ chat_template.jinja, generation_config.json)."""
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path):
            raise TokenizerError(f"{path}: missing (an HF model folder needs tokenizer.json)")
        try:
            with open(path, encoding="utf-8") as f:
                spec = json.load(f)
            for added in spec.get("added_tokens") or ():
                if added.get("content") in RENDERED_MARKERS:
                    added["special"] = False
            backend = FastTokenizer.from_str(json.dumps(spec))
        except Exception as e:
            raise TokenizerError(f"{path}: not a readable tokenizer.json ({e})") from None
        tcfg = _read_json(os.path.join(folder, "tokenizer_config.json"))
        gen = _read_json(os.path.join(folder, "generation_config.json"))
        mcfg = _read_json(os.path.join(folder, "config.json"))

        template = tcfg.get("chat_template") or ""
        if isinstance(template, list):  # named templates: take "default"
            named = [t for t in template if isinstance(t, dict) and isinstance(t.get("template"), str)]
            if not named:
                raise TokenizerError(f"{os.path.join(folder, 'tokenizer_config.json')}: chat_template: expected a "
                                     'string or a list of {"name", "template"} objects')
            template = next((t["template"] for t in named if t.get("name") == "default"), named[0]["template"])
        if not isinstance(template, str):
            raise TokenizerError(f"{os.path.join(folder, 'tokenizer_config.json')}: chat_template: expected a string, "
                                 f"got {type(template).__name__}")
        jinja_path = os.path.join(folder, "chat_template.jinja")
        if os.path.isfile(jinja_path):
            try:
                with open(jinja_path, encoding="utf-8") as f:
                    template = f.read()
            except UnicodeDecodeError as e:
                raise TokenizerError(f"{jinja_path}: not UTF-8 text ({e.reason} at byte {e.start})") from None

        texts = {k: _token_text(tcfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        special = {k: v for k, v in texts.items() if v}
        bos = backend.token_to_id(special["bos_token"]) if "bos_token" in special else None
        if bos is None:
            bos = _first_int(gen.get("bos_token_id", mcfg.get("bos_token_id")))
        eos: set[int] = set()
        eos_id = backend.token_to_id(special["eos_token"]) if "eos_token" in special else None
        if eos_id is not None:
            eos.add(eos_id)
        for source in (gen.get("eos_token_id"), mcfg.get("eos_token_id")):
            eos.update(_ints(source))
        eos.update(_end_of_turn_ids(backend))
        fingerprint = _hash_json({"model": spec.get("model"), "added_tokens": spec.get("added_tokens")})
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_ids=eos,
            chat_template=template,
            fingerprint=fingerprint,
            add_bos=False,  # tokenizer.json's post-processor already adds what the model wants
            special_tokens=special,
        )

    @staticmethod
    def _gguf_backend(meta: dict[str, Any], kind: str, tokens: list[str], token_types: list[int],
                      merges: list[str] | None) -> tuple[FastTokenizer, str]:
        """The tokenizers backend the metadata describes and its fingerprint."""
        if kind == "gpt2":
            backend = byte_level_bpe(tokens, merges or [], meta.get("tokenizer.ggml.pre") or "default")
        else:
            backend = sentencepiece_bpe(tokens, merges, meta.get("tokenizer.ggml.scores"), token_types,
                                         add_space_prefix=meta.get("tokenizer.ggml.add_space_prefix", True))
        # llama.cpp's converter makes every `<｜...｜>` token a control token, DeepSeek-V3's call markers included:
        # those are decoded as text like user-defined ones.
        special_added = [
            AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, token_types, strict=False)
            if ty == _CONTROL and t not in RENDERED_MARKERS
        ]
        user_added = [
            AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, token_types, strict=False)
            if ty == _USER_DEFINED or (ty == _CONTROL and t in RENDERED_MARKERS)
        ]
        if special_added:
            backend.add_special_tokens(special_added)
        if user_added:
            backend.add_tokens(user_added)
        h = xxhash.xxh3_128()
        for part in (tokens, merges or [], token_types, [kind, meta.get("tokenizer.ggml.pre") or ""]):
            h.update(json.dumps(part, ensure_ascii=False).encode())
        return backend, h.hexdigest()

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], kept: tuple[FastTokenizer, str] | None = None) -> Tokenizer:
        """From GGUF `tokenizer.ggml.*` metadata (byte-level BPE "gpt2", sentencepiece "llama", or "gemma4": a
        sentencepiece-style BPE with merges, spaces as U+2581 and byte fallback, as llama.cpp reads it). `kept`: the
        backend and fingerprint an earlier call built from the same metadata (engine/model/weights_cache.py), so
        neither is built again (a 262K-token sentencepiece vocabulary takes seconds)."""
        kind = meta.get("tokenizer.ggml.model")
        tokens: list[str] | None = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise TokenizerError("no tokenizer.ggml.tokens in the metadata")
        token_types = list(meta.get("tokenizer.ggml.token_type") or [])
        merges = meta.get("tokenizer.ggml.merges")
        if kind not in ("gpt2", "llama", "gemma4"):
            raise TokenizerError(f"tokenizer model {kind!r} is not supported (expected gpt2, llama or gemma4)")
        backend, fingerprint = kept if kept is not None else cls._gguf_backend(meta, kind, tokens, token_types, merges)
        bos = meta.get("tokenizer.ggml.bos_token_id")
        eos: set[int] = set()
        for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
            value = meta.get(f"tokenizer.ggml.{key}")
            if value is not None:
                eos.add(int(value))
        eos.update(_end_of_turn_ids(backend))
        add_bos = meta.get("tokenizer.ggml.add_bos_token")
        if add_bos is None:
            add_bos = kind == "llama"
        special = {}
        for name in ("bos", "eos", "unknown", "padding"):
            value = meta.get(f"tokenizer.ggml.{name}_token_id")
            if value is not None and 0 <= int(value) < len(tokens):
                special[{"unknown": "unk", "padding": "pad"}.get(name, name) + "_token"] = tokens[int(value)]
        return cls(
            backend,
            bos_token_id=int(bos) if bos is not None else None,
            eos_token_ids=eos,
            chat_template=meta.get("tokenizer.chat_template") or "",
            fingerprint=fingerprint,
            add_bos=bool(add_bos) and bos is not None,
            special_tokens=special,
        )

    # -- text <-> ids

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special-token text (like <|im_start|>) maps to its single id."""
        # encode_batch releases the GIL (encode does not), so a huge prompt tokenised on a worker thread does
        # not stall the server's event loop; for one text both give the same ids.
        ids = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens and self.add_bos and (not ids or ids[0] != self.bos_token_id):
            assert self.bos_token_id is not None  # add_bos is only set with a BOS token
            ids = [self.bos_token_id, *ids]
        return ids

    def special_text_in(self, text: str) -> str | None:
        """The first special token's text found in `text` (e.g. "<|im_end|>"), or None."""
        found = self._special_text.search(text) if self._special_text is not None else None
        return found.group(0) if found is not None else None

    def encode_text(self, text: str) -> list[int]:
        """Token ids of `text` read as text only: special-token text ("<|im_start|>") is spelled with ordinary
        tokens, never the control token, so a message cannot forge a turn of the template."""
        with self._text_lock:
            if self._text_backend is None:
                copy = FastTokenizer.from_str(self.backend.to_str())
                copy.encode_special_tokens = True
                self._text_backend = copy
        return self._text_backend.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def stream_decoder(self, skip_special_tokens: bool = True) -> StreamDecoder:
        # Harmony's markers are its answer's structure, read back by the server: they stay in the text.
        return StreamDecoder(self, skip_special_tokens and not self.harmony)

    # -- chat

    def use_chat_template(self, template: str) -> None:
        """Render chats with `template` from now on (engine.model.chat_templates chooses it)."""
        self.chat_template = template
        self._template = None
        self.thinking = detect_thinking(self)

    def render_chat(
        self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """The prompt text for `messages` through the model's chat template (as transformers renders it)."""
        if not self.chat_template:
            raise TokenizerError("this model has no chat template; use /v1/completions with a plain prompt")
        if self._template is None:
            self._template = compile_template(self.chat_template)
        context = dict(self.special_tokens)
        context.update(extra)
        return self._template.render(
            messages=[with_joinable_arguments(m) for m in messages], tools=tools,
            add_generation_prompt=add_generation_prompt, **context
        )


class StreamDecoder:
    """Turns a stream of token ids into text deltas that never split a UTF-8 character."""

    # Tokens kept as left context when decoding, so merged spaces/prefixes decode as in the full text.
    _CONTEXT = 4

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window
        self._read = 0  # tokens up to here are already emitted

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a multi-byte character is incomplete)."""
        self._ids.append(int(token_id))
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        full_text = self._tok.decode(self._ids[self._prefix :], self._skip)
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        delta = full_text[len(prefix_text) :] if full_text.startswith(prefix_text) else full_text
        self._read = len(self._ids)
        self._prefix = max(self._read - self._CONTEXT, 0)
        self._trim()
        return delta

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character decodes as U+FFFD)."""
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        full_text = self._tok.decode(self._ids[self._prefix :], self._skip)
        self._read = len(self._ids)
        self._prefix = self._read
        self._trim()
        return full_text[len(prefix_text) :] if full_text.startswith(prefix_text) else full_text

    def _trim(self) -> None:
        if self._prefix > 256:
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0


def _end_of_turn_ids(backend: FastTokenizer) -> set[int]:
    return {i for t in END_OF_TURN_TOKENS if (i := backend.token_to_id(t)) is not None}


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{path}: not valid JSON ({e})") from None
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _ints(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def _first_int(value: Any) -> int | None:
    found = _ints(value)
    return found[0] if found else None


def _hash_json(value: Any) -> str:
    return xxhash.xxh3_128_hexdigest(json.dumps(value, sort_keys=True, ensure_ascii=False).encode())


# ---------------------------------------------------------------- chat templates (as transformers compiles them)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; render its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_template(source: str) -> jinja2.Template:
    """A chat template as the engine renders it (sandboxed, loop controls, the {% generation %} tag); TokenizerError
    naming the syntax error when it does not compile."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(f"chat template does not compile: {e}") from None
