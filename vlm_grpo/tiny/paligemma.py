"""Tiny PaliGemma 2: a SigLIP vision tower and a Gemma 2 text model (a sliding-window and a full-attention layer) at
tiny sizes, its prefix-LM attention (the whole prompt bidirectional, the completion causal), its PIL image processor:
one 32x32 square of 2x2 patches, 4 image tokens. PaliGemma checkpoints have no chat template; this one writes the
images, then the text, as PaliGemma's processor expects (it adds `<bos>` and the closing newline itself)."""

from __future__ import annotations

from typing import Any

from .sizes import HEADS, HIDDEN, INTERMEDIATE, KV_HEADS, LAYERS, VISION_HEADS, VISION_HIDDEN, VISION_LAYERS
from .tokenizer import TokenizerSpec

__all__ = ["IMAGE_SIZES", "TOKENIZER", "parts"]

_TEMPLATE = (
    "{% for message in messages %}{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}<image>{% endif %}{% endfor %}"
    "{% for item in message['content'] %}{% if item['type'] == 'text' %}{{ item['text'] }} {% endif %}{% endfor %}"
    "{% endif %}{% endfor %}"
)

TOKENIZER = TokenizerSpec(
    ["<pad>", "<eos>", "<bos>", "<image>"], "<bos>", ["<eos>"], "<pad>", _TEMPLATE,
    extra_special={"image_token": "<image>"},
)  # fmt: skip
IMAGE_SIZES = {"paligemma": 32}


def parts(name: str, tok: Any, vocab_size: int, image_size: int) -> tuple[Any, Any]:
    """`(config, processor)` of the tiny PaliGemma 2 model."""
    from transformers import PaliGemmaConfig

    from ..media.processor import build_paligemma_processor

    patch = image_size // 2  # 2x2 patches = 4 image tokens
    head_dim = HIDDEN // HEADS
    config = PaliGemmaConfig(
        text_config=dict(
            model_type="gemma2", vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
            num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=head_dim,
            max_position_embeddings=4096, sliding_window=256, query_pre_attn_scalar=head_dim,
            layer_types=["sliding_attention", "full_attention"], pad_token_id=tok.pad_token_id,
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        ),
        vision_config=dict(
            model_type="siglip_vision_model", hidden_size=VISION_HIDDEN, intermediate_size=64,
            num_hidden_layers=VISION_LAYERS, num_attention_heads=VISION_HEADS, image_size=image_size,
            patch_size=patch, vision_use_head=False,
        ),
        image_token_index=tok.convert_tokens_to_ids("<image>"), projection_dim=HIDDEN, hidden_size=HIDDEN,
        vocab_size=vocab_size,
    )  # fmt: skip
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    image_processor = SiglipImageProcessorPil(
        size={"height": image_size, "width": image_size}, image_mean=[0.5] * 3, image_std=[0.5] * 3
    )
    processor = build_paligemma_processor(image_processor, tok, image_seq_length=4, chat_template=tok.chat_template)
    return config, processor
