"""Tiny SmolVLM (SmolVLM2's `smolvlm`): Idefics3's architecture under its own model type, a Llama text model at tiny
sizes, Idefics3's chat template and image tokens, its PIL image processor without image splitting: one square image
of 4x4 patches, pixel-shuffled to 4 image tokens."""

from __future__ import annotations

from typing import Any

from .idefics3 import TOKENIZER as _IDEFICS3_TOKENIZER
from .idefics3 import config_kwargs, image_processor_kwargs
from .tokenizer import TokenizerSpec

__all__ = ["IMAGE_SIZES", "TOKENIZER", "parts"]

TOKENIZER = TokenizerSpec(
    [*_IDEFICS3_TOKENIZER.special_tokens, "<video>"], None, ["<end_of_utterance>"], "<|endoftext|>",
    _IDEFICS3_TOKENIZER.chat_template,
)  # fmt: skip
IMAGE_SIZES = {"smolvlm": 32}


def parts(name: str, tok: Any, vocab_size: int, image_size: int) -> tuple[Any, Any]:
    """`(config, processor)` of the tiny SmolVLM model: Idefics3's, under SmolVLM's classes."""
    from transformers import SmolVLMConfig
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    from ..media.processor import build_image_only_processor

    config = SmolVLMConfig(**config_kwargs(tok, vocab_size, image_size))
    image_processor = SmolVLMImageProcessorPil(**image_processor_kwargs(image_size))
    return config, build_image_only_processor(
        name, image_processor, tok, chat_template=tok.chat_template, image_seq_len=4
    )
