"""Offline tiny vision-language models for tests and the demo.

The Hugging Face Hub is not always reachable (CI, air-gapped clusters), so the test suite and the
embedded demo build their models in code: a real transformers architecture with tiny dimensions and
seeded random weights, a word-level tokenizer carrying the family's real special tokens and chat
template, and the family's real (PIL) image processor. The result is a normal checkpoint directory
that `FastBaseVisionModel.from_pretrained` (or plain transformers) loads like any Hub model.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from .families import family_of, model_types

__all__ = ["MAX_LEARNABLE_WORDS", "TINY_FAMILIES", "build_tiny_vlm", "offline_learning_note", "split_words"]

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
class _Family:
    """What differs between families: special tokens, chat template and the pieces of the config."""

    special_tokens: list[str]
    bos: str | None
    eos: list[str]
    pad: str
    chat_template: str
    extra_special: dict[str, str] = field(default_factory=dict)


_QWEN_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_GEMMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<start_of_image>{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

_IDEFICS3_TEMPLATE = (
    "<|im_start|>"
    "{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}: {{ message['content'] }}"
    "{% else %}{% if message['content'][0]['type'] == 'image' %}:{% else %}: {% endif %}"
    "{% for line in message['content'] %}"
    "{% if line['type'] == 'text' %}{{ line['text'] }}{% elif line['type'] == 'image' %}<image>{% endif %}"
    "{% endfor %}{% endif %}<end_of_utterance>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)

_QWEN_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|image_pad|>", "<|video_pad|>",
]  # fmt: skip

# The tiny models' tokenizers, per family with a record marked `tiny` in `vlm_grpo.families`.
# fmt: off
_FAMILIES: dict[str, _Family] = {
    "qwen2_vl": _Family(_QWEN_TOKENS, None, ["<|im_end|>", "<|endoftext|>"], "<|endoftext|>", _QWEN_TEMPLATE),
    "qwen2_5_vl": _Family(_QWEN_TOKENS, None, ["<|im_end|>", "<|endoftext|>"], "<|endoftext|>", _QWEN_TEMPLATE),
    "qwen3_vl": _Family(_QWEN_TOKENS, None, ["<|im_end|>", "<|endoftext|>"], "<|endoftext|>", _QWEN_TEMPLATE),
    "gemma3": _Family(
        ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",
         "<image_soft_token>"],
        "<bos>", ["<end_of_turn>", "<eos>"], "<pad>", _GEMMA3_TEMPLATE,
        extra_special={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"},
    ),
    "idefics3": _Family(
        ["<|endoftext|>", "<|im_start|>", "<end_of_utterance>", "<fake_token_around_image>", "<image>",
         "<global-img>"] + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)],
        None, ["<end_of_utterance>"], "<|endoftext|>", _IDEFICS3_TEMPLATE,
    ),
}
# fmt: on

TINY_FAMILIES: tuple[str, ...] = model_types(lambda f: f.tiny)

# Tiny-model image geometry. Qwen2/2.5-VL: patch 14, merge 2 -> a 56x56 image is 2x2 merged patches = 4 image
# tokens. Qwen3-VL: patch 16 -> 64x64 for the same 4 tokens. Gemma3 / Idefics3 resize every image to a fixed square.
_DEFAULT_IMAGE_SIZE = {"qwen2_vl": 56, "qwen2_5_vl": 56, "qwen3_vl": 64, "gemma3": 32, "idefics3": 32}

# Small enough that a GRPO step takes ~0.1 s on one CPU thread, big enough to learn a 4-way task.
_HIDDEN, _LAYERS, _HEADS, _KV_HEADS, _INTERMEDIATE = 64, 2, 4, 2, 128
_VISION_HIDDEN, _VISION_LAYERS, _VISION_HEADS = 32, 2, 2


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


def _build_tokenizer(family: _Family, words: Iterable[str]):
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


def _round_up(n: int, multiple: int = 8) -> int:
    return (n + multiple - 1) // multiple * multiple


def _qwen_config(name: str, tok, vocab_size: int):
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig

    ids = {
        "image_token_id": tok.convert_tokens_to_ids("<|image_pad|>"),
        "video_token_id": tok.convert_tokens_to_ids("<|video_pad|>"),
        "vision_start_token_id": tok.convert_tokens_to_ids("<|vision_start|>"),
        "vision_end_token_id": tok.convert_tokens_to_ids("<|vision_end|>"),
    }
    head_dim = _HIDDEN // _HEADS
    text = dict(
        vocab_size=vocab_size, hidden_size=_HIDDEN, intermediate_size=_INTERMEDIATE, num_hidden_layers=_LAYERS,
        num_attention_heads=_HEADS, num_key_value_heads=_KV_HEADS, max_position_embeddings=4096,
        head_dim=head_dim, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.pad_token_id, bos_token_id=None, tie_word_embeddings=False,
    )  # fmt: skip
    # mrope splits head_dim/2 rotary frequencies over (time, height, width); the sections must sum to head_dim/2.
    half = head_dim // 2
    mrope = [half - 2 * (half // 3), half // 3, half // 3]
    vision = dict(depth=_VISION_LAYERS, hidden_size=_VISION_HIDDEN, num_heads=_VISION_HEADS, out_hidden_size=_HIDDEN)
    if name == "qwen3_vl":
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": mrope,
                                   "mrope_interleaved": True}  # fmt: skip
        vision.update(intermediate_size=64, patch_size=16, num_position_embeddings=16, deepstack_visual_indexes=[0])
        return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": mrope}
    if name == "qwen2_5_vl":
        vision.update(intermediate_size=64, patch_size=14, window_size=112, fullatt_block_indexes=[1])
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
    vision = dict(depth=_VISION_LAYERS, embed_dim=_VISION_HIDDEN, num_heads=_VISION_HEADS, hidden_size=_HIDDEN,
                  mlp_ratio=2, patch_size=14)  # fmt: skip
    return Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)


def _qwen_processor(name: str, tok, image_size: int):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from .families import FAMILIES
    from .video_processor import QwenVideoProcessorPil

    patch = 16 if name == "qwen3_vl" else 14
    # The image budget is part of the processor, as on the Hub; tiny models see at most a 4x4 grid of merged patches.
    unit = patch * 2
    common = dict(patch_size=patch, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": unit * unit, "longest_edge": (4 * unit) ** 2}, **common
    )
    # Video: at most a 2x2 grid of merged patches per frame (4 tokens per temporal step); Qwen3-VL's budget covers the
    # whole clip (frames x area), here 16 frames' worth.
    frames = 16 if FAMILIES[name].video_budget == "clip" else 1
    video_processor = QwenVideoProcessorPil(
        FAMILIES[name].video_processor,
        size={"shortest_edge": unit * unit * min(frames, 2), "longest_edge": frames * (2 * unit) ** 2}, **common,
    )  # fmt: skip
    from .processor import build_qwen_processor  # one place knows how to do without torchvision's video processor

    return build_qwen_processor(name, image_processor, tok, video_processor=video_processor)


def _gemma3_parts(tok, vocab_size: int, image_size: int):
    from transformers import Gemma3Config, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    patch = image_size // 4  # 4x4 patches pooled to 2x2 = 4 image tokens
    config = Gemma3Config(
        text_config=dict(
            vocab_size=vocab_size, hidden_size=_HIDDEN, intermediate_size=_INTERMEDIATE, num_hidden_layers=_LAYERS,
            num_attention_heads=_HEADS, num_key_value_heads=_KV_HEADS, head_dim=_HIDDEN // _HEADS,
            max_position_embeddings=4096, sliding_window=64, query_pre_attn_scalar=_HIDDEN // _HEADS,
            layer_types=["sliding_attention", "full_attention"], pad_token_id=tok.pad_token_id,
            eos_token_id=tok.convert_tokens_to_ids("<end_of_turn>"), bos_token_id=tok.bos_token_id,
        ),
        vision_config=dict(
            model_type="siglip_vision_model", hidden_size=_VISION_HIDDEN, intermediate_size=64,
            num_hidden_layers=_VISION_LAYERS, num_attention_heads=_VISION_HEADS, image_size=image_size,
            patch_size=patch, vision_use_head=False,
        ),
        mm_tokens_per_image=4,
        boi_token_index=tok.convert_tokens_to_ids("<start_of_image>"),
        eoi_token_index=tok.convert_tokens_to_ids("<end_of_image>"),
        image_token_index=tok.convert_tokens_to_ids("<image_soft_token>"),
    )  # fmt: skip
    image_processor = Gemma3ImageProcessorPil(
        size={"height": image_size, "width": image_size}, image_mean=[0.5] * 3, image_std=[0.5] * 3
    )
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tok, image_seq_length=4)
    return config, processor


def _idefics3_parts(tok, vocab_size: int, image_size: int):
    from transformers import Idefics3Config, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    patch = image_size // 4  # 4x4 patches; pixel shuffle by 2 -> 4 image tokens
    config = Idefics3Config(
        text_config=dict(
            model_type="llama", vocab_size=vocab_size, hidden_size=_HIDDEN, intermediate_size=_INTERMEDIATE,
            num_hidden_layers=_LAYERS, num_attention_heads=_HEADS, num_key_value_heads=_KV_HEADS,
            max_position_embeddings=4096, pad_token_id=tok.pad_token_id,
            eos_token_id=tok.convert_tokens_to_ids("<end_of_utterance>"), bos_token_id=None,
            tie_word_embeddings=False,
        ),
        vision_config=dict(
            hidden_size=_VISION_HIDDEN, intermediate_size=64, num_hidden_layers=_VISION_LAYERS,
            num_attention_heads=_VISION_HEADS, image_size=image_size, patch_size=patch,
        ),
        scale_factor=2, image_token_id=tok.convert_tokens_to_ids("<image>"), pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )  # fmt: skip
    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=False, size={"longest_edge": image_size},
        max_image_size={"longest_edge": image_size}, image_mean=[0.5] * 3, image_std=[0.5] * 3,
    )  # fmt: skip
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tok, image_seq_len=4)
    return config, processor


def _init_zero_projections(model: torch.nn.Module) -> None:
    # Gemma3's `_init_weights` zeroes the image projection (the real checkpoint overwrites it), so a random
    # tiny Gemma3 would ignore its images entirely and vision LoRA would get no gradient. Give such
    # all-zero projection matrices a random init scaled like a Linear layer.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "projector" in name and param.dim() == 2 and not param.any():
                param.normal_(0.0, param.shape[0] ** -0.5)


def build_tiny_vlm(
    family: str,
    out_dir: str | os.PathLike | None = None,
    *,
    seed: int = 0,
    words: Iterable[str] | None = None,
    image_size: int | None = None,
) -> str:
    """Write a complete, offline tiny VLM checkpoint directory and return its path.

    Args:
        family: one of `TINY_FAMILIES` (`qwen2_vl`, `qwen2_5_vl`, `qwen3_vl`, `gemma3`, `idefics3`).
        out_dir: where to write (created if needed; files already there are overwritten, others left alone). None:
            `~/.cache/vlm_grpo/tiny-models/<family>-<hash of the settings>` (under `$XDG_CACHE_HOME` if set).
        seed: seeds the random weights, so the same seed gives the same model.
        words: extra vocabulary (e.g. `vlm_grpo.data.answer_words(task)`) so each answer is a single token.
        image_size: the image side the model is built for. Qwen families accept any size (it sets the pixel
            budget's unit); Gemma3 and Idefics3 resize every image to this square. Must be a multiple of 4
            (of 28 for Qwen2/2.5-VL, of 32 for Qwen3-VL).

    Returns:
        The checkpoint directory: config, seeded weights (safetensors), generation config and processor
        (image processor, tokenizer, chat template), loadable with `FastBaseVisionModel.from_pretrained`.
    """
    if family not in TINY_FAMILIES:
        raise ValueError(f"Unknown tiny VLM family {family!r}; choose one of {', '.join(TINY_FAMILIES)}.")
    image_size = image_size or _DEFAULT_IMAGE_SIZE[family]
    if image_size <= 0 or image_size % 4:
        raise ValueError(f"image_size must be a positive multiple of 4, got {image_size}.")
    spec = _FAMILIES[family]
    extra = [w for w in (words or []) if w and w.strip()]
    if any(len(w.split()) != 1 for w in extra):
        raise ValueError("`words` must be single words without spaces (each becomes one token).")
    tok = _build_tokenizer(spec, extra)

    from transformers import AutoModelForImageTextToText, GenerationConfig

    vocab_size = _round_up(len(tok))
    if family_of(family).pixel_budget:  # Qwen-VL
        config = _qwen_config(family, tok, vocab_size)
        processor = _qwen_processor(family, tok, image_size)
    elif family == "gemma3":
        config, processor = _gemma3_parts(tok, vocab_size, image_size)
    else:
        config, processor = _idefics3_parts(tok, vocab_size, image_size)

    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    _init_zero_projections(model)
    eos_ids = [tok.convert_tokens_to_ids(t) for t in spec.eos]
    model.generation_config = GenerationConfig(
        eos_token_id=eos_ids, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, do_sample=True
    )
    from .callbacks import library_bars_off
    from .files import follow_umask

    out_dir = str(out_dir) if out_dir is not None else _cache_dir(family, seed, extra, image_size)
    os.makedirs(out_dir, exist_ok=True)
    with library_bars_off():  # a "Writing model shards" bar for a file written in no time
        model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    for name in os.listdir(out_dir):  # safetensors writes weights 0600; the rest follows the umask already
        if name.endswith(".safetensors"):
            follow_umask(os.path.join(out_dir, name))
    return out_dir


def _cache_dir(family: str, seed: int, words: list[str], image_size: int) -> str:
    """Where `build_tiny_vlm` writes when given no directory: one folder per model under the user's cache
    (`$XDG_CACHE_HOME` or ~/.cache), `vlm_grpo/tiny-models/<family>-<hash of the settings>`, rewritten by each build."""
    key = json.dumps([family, seed, words, image_size]).encode()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "vlm_grpo", "tiny-models", f"{family}-{hashlib.sha256(key).hexdigest()[:12]}")
