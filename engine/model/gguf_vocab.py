"""The tokenizers backends of GGUF vocabularies (`tokenizer.ggml.*`): byte-level BPE with the pre-tokenizer splits
llama.cpp defines for each `tokenizer.ggml.pre`, and sentencepiece BPE. engine/model/tokenizer.py adds the special
tokens and builds the Tokenizer around them."""

from __future__ import annotations

from typing import cast

from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as FastTokenizer

# Pre-tokenizer split patterns by GGUF `tokenizer.ggml.pre`, as llama.cpp defines them.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# o200k (gpt-oss; llama.cpp's GPT4O pre-tokenizer, from the model's tokenizer.json): a word splits at a capital.
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_BY_PRE = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT, "pixtral": _LLAMA3_SPLIT,
    # GLM-4.x (llama.cpp's CHATGLM4 pre-tokenizer: the same expression)
    "glm4": _LLAMA3_SPLIT, "glm5": _LLAMA3_SPLIT, "chatglm-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT, "megrez": _QWEN2_SPLIT,
    "gpt-4o": _GPT4O_SPLIT,
}
# Several expressions, each splitting the pieces of the one before (llama.cpp's DEEPSEEK3_LLM: DeepSeek-V3 and R1).
_SPLITS_BY_PRE = {
    "deepseek-v3": (
        r"\p{N}{1,3}",
        "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
        r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
        r"""| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
    ),
}
# llama.cpp splits every digit on its own before the GPT-2 pattern for these.
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")


def byte_level_bpe(tokens: list[str], merges: list[str], pre: str) -> FastTokenizer:
    """A GGUF "gpt2" vocabulary: byte-level BPE, split first as llama.cpp splits for `pre`."""
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [cast(tuple[str, str], tuple(m.split(" ", 1))) for m in merges]  # a merge is "left right"
    backend = FastTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    split = _SPLIT_BY_PRE.get(pre)
    if pre in _SPLITS_BY_PRE:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _SPLITS_BY_PRE[pre]]
            + [pre_tokenizers.ByteLevel(False, use_regex=False)]
        )
    elif split is not None:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), pre_tokenizers.ByteLevel(False, use_regex=False)]
        )
    elif pre in _DIGITS_THEN_GPT2:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(False, use_regex=True)]
        )
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    return backend


def sentencepiece_bpe(
    tokens: list[str], merges: list[str] | None, scores: list[float] | None, token_types: list[int],
    *, add_space_prefix: bool = True,
) -> FastTokenizer:
    """A GGUF "llama" vocabulary: sentencepiece BPE with byte fallback, its merges given or made from scores."""
    vocab = {t: i for i, t in enumerate(tokens)}
    if merges:
        pairs = [cast(tuple[str, str], tuple(m.split(" ", 1))) for m in merges]  # a merge is "left right"
    else:
        pairs = _merges_from_scores(tokens, scores or [0.0] * len(tokens))
    unk = next((t for t, ty in zip(tokens, token_types, strict=False) if ty == 2), None)  # 2 = UNKNOWN
    backend = FastTokenizer(models.BPE(vocab=vocab, merges=pairs, unk_token=unk, fuse_unk=True, byte_fallback=True))
    # Sentencepiece's dummy prefix: a space before the text (and stripped from the decoded text), unless the
    # file turns it off (tokenizer.ggml.add_space_prefix false: Gemma).
    prefix = [normalizers.Prepend("\u2581")] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", "\u2581")])
    strip = [decoders.Strip(" ", 1, 0)] if add_space_prefix else []
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    return backend


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Sentencepiece files carry scores, not merges: every split of a token into two known pieces is a merge,
    ranked by the merged token's score."""
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked: list[tuple[float, int, int, tuple[str, str]]] = []
    for token, index in vocab.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[index], vocab[left], vocab[right], (left, right)))
    ranked.sort()
    return [pair for *_, pair in ranked]
