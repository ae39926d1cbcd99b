"""Tiny Gemma 3: the real architecture at tiny sizes (a sliding-window and a full-attention layer), Gemma's chat
template and image tokens, its PIL image processor. Every image is resized to one square of 4x4 patches, pooled to 4
image tokens."""

from __future__ import annotations

from typing import Any

from .sizes import HEADS, HIDDEN, INTERMEDIATE, KV_HEADS, LAYERS, VISION_HEADS, VISION_HIDDEN, VISION_LAYERS
from .tokenizer import TokenizerSpec

__all__ = ["IMAGE_SIZES", "TOKENIZER", "parts"]

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

TOKENIZER = TokenizerSpec(
    ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",
     "<image_soft_token>"],
    "<bos>", ["<end_of_turn>", "<eos>"], "<pad>", _GEMMA3_TEMPLATE,
    extra_special={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"},
)  # fmt: skip
IMAGE_SIZES = {"gemma3": 32}


def parts(name: str, tok: Any, vocab_size: int, image_size: int) -> tuple[Any, Any]:
    """`(config, processor)` of the tiny Gemma 3 model."""
    from transformers import Gemma3Config, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    patch = image_size // 4  # 4x4 patches pooled to 2x2 = 4 image tokens
    config = Gemma3Config(
        text_config=dict(
            vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HIDDEN // HEADS,
            max_position_embeddings=4096, sliding_window=64, query_pre_attn_scalar=HIDDEN // HEADS,
            layer_types=["sliding_attention", "full_attention"], pad_token_id=tok.pad_token_id,
            eos_token_id=tok.convert_tokens_to_ids("<end_of_turn>"), bos_token_id=tok.bos_token_id,
        ),
        vision_config=dict(
            model_type="siglip_vision_model", hidden_size=VISION_HIDDEN, intermediate_size=64,
            num_hidden_layers=VISION_LAYERS, num_attention_heads=VISION_HEADS, image_size=image_size,
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
