"""Tiny Idefics3 (SmolVLM's architecture): a Llama text model at tiny sizes, Idefics3's chat template and image tokens,
its PIL image processor without image splitting: one square image of 4x4 patches, pixel-shuffled to 4 image tokens."""

from __future__ import annotations

from typing import Any

from .sizes import VISION_HEADS, VISION_HIDDEN, VISION_LAYERS, text_config
from .tokenizer import TokenizerSpec

__all__ = ["IMAGE_SIZES", "TOKENIZER", "config_kwargs", "image_processor_kwargs", "parts"]

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


def config_kwargs(tok: Any, vocab_size: int, image_size: int) -> dict[str, Any]:
    """The tiny Idefics3 config's arguments (SmolVLM's config takes the same): a Llama text model, a vision tower of
    4x4 patches pixel-shuffled by 2 to 4 image tokens."""
    return dict(
        text_config=text_config("llama", tok, vocab_size, "<end_of_utterance>"),
        vision_config=dict(
            hidden_size=VISION_HIDDEN, intermediate_size=64, num_hidden_layers=VISION_LAYERS,
            num_attention_heads=VISION_HEADS, image_size=image_size, patch_size=image_size // 4,
        ),
        scale_factor=2, image_token_id=tok.convert_tokens_to_ids("<image>"), pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )  # fmt: skip


def image_processor_kwargs(image_size: int) -> dict[str, Any]:
    """The PIL image processor's arguments (SmolVLM's takes the same): one square image, no splitting."""
    return dict(do_image_splitting=False, size={"longest_edge": image_size}, max_image_size={"longest_edge": image_size},
                image_mean=[0.5] * 3, image_std=[0.5] * 3)  # fmt: skip


def parts(name: str, tok: Any, vocab_size: int, image_size: int) -> tuple[Any, Any]:
    """`(config, processor)` of the tiny Idefics3 model."""
    from transformers import Idefics3Config, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    config = Idefics3Config(**config_kwargs(tok, vocab_size, image_size))
    image_processor = Idefics3ImageProcessorPil(**image_processor_kwargs(image_size))
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tok, image_seq_len=4)
    return config, processor
