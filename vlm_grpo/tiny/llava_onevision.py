"""Tiny LLaVA-OneVision: a SigLIP vision tower and a Qwen2 text model at tiny sizes, ChatML with `<image>`, its PIL
image processor with one any-resolution tile: a 32x32 image is a base view and one tile of 2x2 patches, 10 image
tokens (4 + 4 + a newline per row), 5 per image in a prompt with several (base view only)."""

from __future__ import annotations

from typing import Any

from .sizes import VISION_HEADS, VISION_HIDDEN, VISION_LAYERS, text_config
from .tokenizer import TokenizerSpec

__all__ = ["IMAGE_SIZES", "TOKENIZER", "parts"]

_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}{% if item['type'] == 'image' %}<image>\n"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TOKENIZER = TokenizerSpec(
    ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>"], None, ["<|im_end|>"], "<|endoftext|>",
    _TEMPLATE, extra_special={"image_token": "<image>", "video_token": "<video>"},
)  # fmt: skip
IMAGE_SIZES = {"llava_onevision": 32}


def parts(name: str, tok: Any, vocab_size: int, image_size: int) -> tuple[Any, Any]:
    """`(config, processor)` of the tiny LLaVA-OneVision model."""
    from transformers import LlavaOnevisionConfig
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    from ..media.processor import build_image_only_processor

    patch = image_size // 2  # 2x2 patches per view
    pinpoints = [[image_size, image_size]]  # one tile besides the base view
    config = LlavaOnevisionConfig(
        text_config=text_config("qwen2", tok, vocab_size, "<|im_end|>"),
        vision_config=dict(
            model_type="siglip_vision_model", hidden_size=VISION_HIDDEN, intermediate_size=64,
            num_hidden_layers=VISION_LAYERS, num_attention_heads=VISION_HEADS, image_size=image_size,
            patch_size=patch, vision_use_head=False,
        ),
        image_token_index=tok.convert_tokens_to_ids("<image>"), video_token_index=tok.convert_tokens_to_ids("<video>"),
        image_grid_pinpoints=pinpoints, vision_feature_select_strategy="full", vision_feature_layer=-1,
        vision_aspect_ratio="anyres_max_9", tie_word_embeddings=False,
    )  # fmt: skip
    image_processor = LlavaOnevisionImageProcessorPil(
        size={"height": image_size, "width": image_size}, image_grid_pinpoints=pinpoints, image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
    )  # fmt: skip
    processor = build_image_only_processor(
        name, image_processor, tok, chat_template=tok.chat_template, num_image_tokens=4,
        vision_feature_select_strategy="full", vision_aspect_ratio="anyres_max_9",
    )  # fmt: skip
    return config, processor
