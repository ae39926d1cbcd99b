"""Tiny LFM2-VL: LFM2's text model at tiny sizes (a short-convolution layer, then a full-attention one), a SigLIP2
NaFlex vision tower, the chat template and image tokens of the checkpoints, and the one-tile PIL image processor
(`vlm_grpo.media.lfm2_image_processor`): 8-px patches, downsample 2, a 32x32 image gives 4 image tokens."""

from __future__ import annotations

from typing import Any

from .sizes import HEADS, HIDDEN, INTERMEDIATE, KV_HEADS, VISION_HEADS, VISION_HIDDEN, VISION_LAYERS
from .tokenizer import TokenizerSpec

__all__ = ["IMAGE_SIZES", "TOKENIZER", "parts"]

_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}{% if item['type'] == 'image' %}<image>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOKENIZER = TokenizerSpec(
    ["<|pad|>", "<|startoftext|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<|image_start|>",
     "<|image_end|>", "<|img_thumbnail|>"] + [f"<|img_row_{r}_col_{c}|>" for r in range(1, 4) for c in range(1, 4)],
    "<|startoftext|>", ["<|im_end|>", "<|endoftext|>"], "<|pad|>", _TEMPLATE,
)  # fmt: skip
IMAGE_SIZES = {"lfm2_vl": 32}
_LAYERS = ["conv", "full_attention"]


def parts(name: str, tok: Any, vocab_size: int, image_size: int) -> tuple[Any, Any]:
    """`(config, processor)` of the tiny LFM2-VL model."""
    from transformers import Lfm2VlConfig, Lfm2VlProcessor

    from ..media.lfm2_image_processor import Lfm2VlImageProcessorPil

    config = Lfm2VlConfig(
        text_config=dict(
            model_type="lfm2", vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
            block_auto_adjust_ff_dim=False, num_hidden_layers=len(_LAYERS), layer_types=list(_LAYERS),
            num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, conv_L_cache=3, max_position_embeddings=4096,
            pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
            eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), tie_word_embeddings=False,
        ),
        vision_config=dict(
            model_type="siglip2_vision_model", hidden_size=VISION_HIDDEN, intermediate_size=64,
            num_hidden_layers=VISION_LAYERS, num_attention_heads=VISION_HEADS, patch_size=image_size // 4,
            num_patches=16, vision_use_head=False,
        ),
        image_token_id=tok.convert_tokens_to_ids("<image>"), projector_hidden_size=HIDDEN, downsample_factor=2,
        tie_word_embeddings=False,
    )  # fmt: skip
    image_processor = Lfm2VlImageProcessorPil(
        encoder_patch_size=image_size // 4, downsample_factor=2, min_image_tokens=1, max_image_tokens=4,
        do_image_splitting=False, image_mean=[0.5] * 3, image_std=[0.5] * 3,
    )  # fmt: skip
    return config, Lfm2VlProcessor(image_processor=image_processor, tokenizer=tok, chat_template=_TEMPLATE)
