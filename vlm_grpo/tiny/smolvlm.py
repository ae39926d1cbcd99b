"""Tiny SmolVLM (SmolVLM2's `smolvlm`): Idefics3's architecture under its own model type, a Llama text model at tiny
sizes, Idefics3's chat template and image tokens, its PIL image processor without image splitting: one square image
of 4x4 patches, pixel-shuffled to 4 image tokens."""

from __future__ import annotations

from typing import Any

from .idefics3 import TOKENIZER as _IDEFICS3_TOKENIZER
from .sizes import HEADS, HIDDEN, INTERMEDIATE, KV_HEADS, LAYERS, VISION_HEADS, VISION_HIDDEN, VISION_LAYERS
from .tokenizer import TokenizerSpec

__all__ = ["IMAGE_SIZES", "TOKENIZER", "parts"]

TOKENIZER = TokenizerSpec(
    [*_IDEFICS3_TOKENIZER.special_tokens, "<video>"], None, ["<end_of_utterance>"], "<|endoftext|>",
    _IDEFICS3_TOKENIZER.chat_template,
)  # fmt: skip
IMAGE_SIZES = {"smolvlm": 32}


def parts(name: str, tok: Any, vocab_size: int, image_size: int) -> tuple[Any, Any]:
    """`(config, processor)` of the tiny SmolVLM model."""
    from transformers import SmolVLMConfig
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    from ..media.processor import build_image_only_processor

    patch = image_size // 4  # 4x4 patches; pixel shuffle by 2 -> 4 image tokens
    config = SmolVLMConfig(
        text_config=dict(
            model_type="llama", vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
            num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
            max_position_embeddings=4096, pad_token_id=tok.pad_token_id,
            eos_token_id=tok.convert_tokens_to_ids("<end_of_utterance>"), bos_token_id=None,
            tie_word_embeddings=False,
        ),
        vision_config=dict(
            hidden_size=VISION_HIDDEN, intermediate_size=64, num_hidden_layers=VISION_LAYERS,
            num_attention_heads=VISION_HEADS, image_size=image_size, patch_size=patch,
        ),
        scale_factor=2, image_token_id=tok.convert_tokens_to_ids("<image>"), pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )  # fmt: skip
    image_processor = SmolVLMImageProcessorPil(
        do_image_splitting=False, size={"longest_edge": image_size},
        max_image_size={"longest_edge": image_size}, image_mean=[0.5] * 3, image_std=[0.5] * 3,
    )  # fmt: skip
    return config, build_image_only_processor(
        name, image_processor, tok, chat_template=tok.chat_template, image_seq_len=4
    )
