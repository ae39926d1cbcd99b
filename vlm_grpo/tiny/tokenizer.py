"""The tiny models' tokenizers: word-level, every word one token, with each family's special tokens and chat template.

A random tiny model samples each token with probability ~1/vocabulary, so the vocabulary is kept small: the base
words (what chat templates, task prompts and rewards use) and the words a task or a user's data needs. Tool calling
needs text back exactly as written (TRL parses the calls out of the decoded completion): `build_text_tokenizer`, a
byte-level BPE over the same words.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "MAX_LEARNABLE_WORDS",
    "TokenizerSpec",
    "build_text_tokenizer",
    "build_tokenizer",
    "build_word_level_tokenizer",
    "offline_learning_note",
    "split_words",
    "text_pieces",
]

# Words the tiny tokenizer always knows: what the chat templates, task prompts and rewards use.
# Anything else becomes <unk>, which is fine for a model that starts from random weights.
_BASE_WORDS = (
    "system user assistant model User Assistant You are a helpful . , : ? ! ' ( ) [ ] < > / "
    "what which where how many is the of in on to and or shape image answer with one word number"
).split()  # deliberately small: a random model samples each token with probability ~1/vocab, so fewer tokens
# means a task's answer words show up in early rollouts often enough for GRPO to have a signal.


# A random tiny model says a one-word answer and stops with probability ~1/vocabulary^2, and GRPO learns only from
# groups where someone did. Measured with the demo's settings (400 steps) on a 3-colour JSONL task, its prompts padded
# with made-up words: 50 words learned 0 -> 1.0 (the reward rising from step ~200), 95 words reached 0.67 (rising
# from step ~350), 379 words stayed at 0.
MAX_LEARNABLE_WORDS = 100


def split_words(text: str) -> list[str]:
    """`text` split as the tiny tokenizers split it (`tokenizers`' Whitespace pre-tokenizer: words and runs of
    punctuation), so each piece is one token once it is in the vocabulary (`build_tiny_vlm(words=...)`)."""
    return [piece for piece, _ in _whitespace_splitter().pre_tokenize_str(text)]


@functools.cache
def _whitespace_splitter() -> Any:
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Whitespace()


def offline_learning_note(words: Iterable[str], answers: Iterable[Any]) -> str | None:
    """Why a tiny model built from scratch knowing `words` (`build_tiny_vlm(words=...)`) is unlikely to learn to say
    `answers` (gold answers: strings, numbers, or lists of accepted strings), in one line; None when nothing stands in
    the way. It starts from random weights, so it must first say an answer by chance for GRPO to reward it."""
    answers = [a if isinstance(a, (list, tuple)) else [a] for a in answers]
    long = [accepted for accepted in answers if accepted and all(len(split_words(str(a))) != 1 for a in accepted)]
    if long:
        example = str(long[0][0])
        return (f"{len(long)} of {len(answers)} gold answers are several tokens to the offline tiny model (e.g. "
                f"{example!r}: {' '.join(split_words(example))}), which it almost never says by chance, so it will "
                "learn little; give --model a pretrained VLM, or use one-word answers.")  # fmt: skip
    vocabulary = set(words) | set(_BASE_WORDS)
    if len(vocabulary) > MAX_LEARNABLE_WORDS:
        return (f"with your data's words the offline tiny model knows {len(vocabulary)} words (over "
                f"{MAX_LEARNABLE_WORDS}), so it rarely says an answer by chance and learns little in a smoke run's steps; "
                "give --model a pretrained VLM, or use shorter prompts.")  # fmt: skip
    return None


@dataclass
class TokenizerSpec:
    """What differs between families' tokenizers: special tokens, chat template, BOS / EOS / pad."""

    special_tokens: list[str]
    bos: str | None
    eos: list[str]
    pad: str
    chat_template: str
    extra_special: dict[str, str] = field(default_factory=dict)
    # Added tokens that are not special (Qwen's `<tool_call>`): kept by `decode(skip_special_tokens=True)`.
    added: list[str] = field(default_factory=list)


def build_word_level_tokenizer(
    vocab: dict[str, int], special_tokens: Iterable[str], unk_token: str, **tokenizer_kwargs: Any
) -> Any:
    """A fast tokenizer in which every word of `vocab` is one token (so task answers are single tokens).

    `special_tokens` are split out before the word split; one missing from `vocab` takes the next free id.
    `tokenizer_kwargs` reach `PreTrainedTokenizerFast` (`pad_token`, `eos_token`, `chat_template`, ...). Pads on the
    left, as generation does. Also builds the benchmarks' real-vocabulary tokenizer (`benchmarks/real_arch.py`).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk_token))
    # Whitespace splits words from punctuation (`colour?` -> `colour`, `?`), so prompts tokenize sensibly.
    backend.pre_tokenizer = _whitespace_splitter()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=True)  # joins words with single spaces
    # Registered on the backend so `<|image_pad|><|image_pad|>` splits into tokens before the word split.
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token=unk_token, padding_side="left", **tokenizer_kwargs
    )


def build_tokenizer(family: TokenizerSpec, words: Iterable[str]) -> Any:
    """The family's tokenizer: its special tokens, the base words and `words`, each one token."""
    vocab: dict[str, int] = {}
    for token in ["<unk>", *family.special_tokens, *_BASE_WORDS, *words]:
        vocab.setdefault(token, len(vocab))
    return build_word_level_tokenizer(
        vocab,
        family.special_tokens,
        "<unk>",
        pad_token=family.pad,
        eos_token=family.eos[0],
        bos_token=family.bos,
        extra_special_tokens=dict(family.extra_special),
        chat_template=family.chat_template,
        model_max_length=4096,
    )


# Qwen's pre-tokenization (transformers' `Qwen3_5Tokenizer`, which rebuilds any Qwen3.5 tokenizer it loads around this
# regex, byte-level BPE and NFC, whatever `tokenizer.json` says): a text tokenizer built the same way reloads unchanged.
_QWEN_PRETOKENIZE = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# The words of tool schemas and calls (`{"name": ..., "arguments": ...}`, Qwen3.5's `<function=...>`).
_TOOL_WORDS = (
    "name arguments function parameter type object properties required description integer number string".split()
)


def text_pieces(text: str) -> list[str]:
    """The distinct pieces Qwen's pre-tokenizer cuts `text` into (words, digits, runs of punctuation), leading spaces
    dropped: given to `build_text_tokenizer(pieces=...)`, each becomes one token.

    >>> text_pieces('{"name": "zoom", "x1": 16}')
    ['{"', 'name', '":', '"', 'zoom', '",', 'x', '1', '6', '}']
    """
    import regex

    return list(dict.fromkeys(p.strip(" ") for p in regex.findall(_QWEN_PRETOKENIZE, text) if p.strip()))


def build_text_tokenizer(
    family: TokenizerSpec, words: Iterable[str], pieces: Iterable[str] = (), phrases: Iterable[str] = ()
) -> Any:
    """The family's tokenizer as a byte-level BPE, the kind real Qwen tokenizers are: it decodes any text back exactly
    (`decode(encode(text)) == text`). For tool calling: TRL parses tool calls out of the decoded completion (JSON or
    XML inside `<tool_call>`), which the word-level tokenizer (`build_tokenizer`: spaces between all tokens, unknown
    punctuation) would break.

    The base words, the tool schema words, `words` and `pieces` (`text_pieces` of text the model will read often,
    e.g. its tools' schemas: fewer tokens per prompt) are one token each, with and without a leading space (merges
    learned from them alone); any other text falls back to bytes. The family's special tokens are split out first, and
    its `added` tokens (not special: decoding with `skip_special_tokens=True` keeps them), and `phrases`: whole texts
    that become one token each wherever they occur, added as those are (e.g. a tool call the model is taught to write:
    one token to sample rather than fifty that sampling can break).
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN_PRETOKENIZE), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    backend.decoder = decoders.ByteLevel()
    known = list(dict.fromkeys([*_BASE_WORDS, *_TOOL_WORDS, *words, *pieces]))
    trainer = trainers.BpeTrainer(
        vocab_size=1_000_000, min_frequency=1, show_progress=False, special_tokens=["<unk>", *family.special_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    backend.train_from_iterator([f"{w} {w}" for w in known], trainer=trainer)  # each word bare and after a space
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in family.special_tokens])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in [*family.added, *phrases]])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", padding_side="left", pad_token=family.pad,
        eos_token=family.eos[0], bos_token=family.bos, extra_special_tokens=dict(family.extra_special),
        chat_template=family.chat_template, model_max_length=4096,
    )  # fmt: skip
