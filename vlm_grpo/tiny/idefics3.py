"""Tiny Idefics3 (SmolVLM's architecture): a Llama text model at tiny sizes, Idefics3's chat template and image tokens,
its PIL image processor without image splitting: one square image of 4x4 patches, pixel-shuffled to 4 image tokens."""

from __future__ import annotations

from typing import Any

from .sizes import HEADS, HIDDEN, INTERMEDIATE, KV_HEADS, LAYERS, VISION_HEADS, VISION_HIDDEN, VISION_LAYERS
from .tokenizer import TokenizerSpec

__all__ = ["IMAGE_SIZES", "TOKENIZER", "parts"]

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

TOKENIZER = TokenizerSpec(
    ["<|endoftext|>", "<|im_start|>", "<end_of_utterance>", "<fake_token_around_image>", "<image>", "<global-img>"]
    + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)],
    None, ["<end_of_utterance>"], "<|endoftext|>", _IDEFICS3_TEMPLATE,
)  # fmt: skip
IMAGE_SIZES = {"idefics3": 32}


def parts(name: str, tok: Any, vocab_size: int, image_size: int) -> tuple[Any, Any]:
    """`(config, processor)` of the tiny Idefics3 model."""
    from transformers import Idefics3Config, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    patch = image_size // 4  # 4x4 patches; pixel shuffle by 2 -> 4 image tokens
    config = Idefics3Config(
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
    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=False, size={"longest_edge": image_size},
        max_image_size={"longest_edge": image_size}, image_mean=[0.5] * 3, image_std=[0.5] * 3,
    )  # fmt: skip
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tok, image_seq_len=4)
    return config, processor
