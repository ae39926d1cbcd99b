"""Tiny InternVL (the transformers-native InternVL 3 / 3.5 format): an InternViT vision tower and a Qwen2 text model at
tiny sizes, ChatML with `<IMG_CONTEXT>`, the PIL image processor (GOT-OCR2's) with one tile per image: a 32x32 tile of
4x4 patches, pixel-shuffled to 4 image tokens."""

from __future__ import annotations

from typing import Any

from .sizes import VISION_HEADS, VISION_HIDDEN, VISION_LAYERS, text_config
from .tokenizer import TokenizerSpec

__all__ = ["IMAGE_SIZES", "TOKENIZER", "parts"]

_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}{% if item['type'] == 'image' %}<IMG_CONTEXT>\n"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TOKENIZER = TokenizerSpec(
    ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>", "<video>"], None,
    ["<|im_end|>"], "<|endoftext|>", _TEMPLATE,
    extra_special={"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
                   "video_token": "<video>"},
)  # fmt: skip
IMAGE_SIZES = {"internvl": 32}


def parts(name: str, tok: Any, vocab_size: int, image_size: int) -> tuple[Any, Any]:
    """`(config, processor)` of the tiny InternVL model."""
    from transformers import InternVLConfig
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    from ..media.processor import build_image_only_processor

    patch = image_size // 4  # 4x4 patches, pixel shuffle 0.5 -> 2x2 = 4 tokens per tile
    config = InternVLConfig(
        text_config=text_config("qwen2", tok, vocab_size, "<|im_end|>"),
        vision_config=dict(
            hidden_size=VISION_HIDDEN, intermediate_size=64, num_hidden_layers=VISION_LAYERS,
            num_attention_heads=VISION_HEADS, image_size=[image_size, image_size], patch_size=[patch, patch],
        ),
        image_token_id=tok.convert_tokens_to_ids("<IMG_CONTEXT>"), image_seq_length=4, downsample_ratio=0.5,
        vision_feature_layer=-1, vision_feature_select_strategy="default", tie_word_embeddings=False,
    )  # fmt: skip
    # InternVL's processor always crops to tiles (up to max_patches, plus a thumbnail); one tile per image here.
    image_processor = GotOcr2ImageProcessorPil(
        size={"height": image_size, "width": image_size}, crop_to_patches=True, min_patches=1, max_patches=1,
        image_mean=[0.5] * 3, image_std=[0.5] * 3,
    )  # fmt: skip
    return config, build_image_only_processor(
        name, image_processor, tok, chat_template=tok.chat_template, image_seq_length=4
    )
