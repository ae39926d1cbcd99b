"""Tiny Mistral 3 (Mistral Small 3.1 / 3.2, Ministral 3's vision models): a Pixtral vision tower and a Mistral text
model at tiny sizes, `[INST]` turns with `[IMG]` tokens, Pixtral's PIL image processor: an image's longest edge fitted
to 32 px, 8 px patches merged 2x2, so a square image is 2 rows of 2 `[IMG]` tokens (4), each row closed by
`[IMG_BREAK]` / `[IMG_END]`."""

from __future__ import annotations

from typing import Any

from .sizes import HEADS, HIDDEN, INTERMEDIATE, KV_HEADS, LAYERS, VISION_HEADS, VISION_HIDDEN, VISION_LAYERS
from .tokenizer import TokenizerSpec

__all__ = ["IMAGE_SIZES", "TOKENIZER", "parts"]

_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}[INST]{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}{% if item['type'] == 'image' %}[IMG]"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if message['role'] == 'user' %}[/INST]{% else %}{{ eos_token }}{% endif %}{% endfor %}"
)

TOKENIZER = TokenizerSpec(
    ["<pad>", "<s>", "</s>", "[INST]", "[/INST]", "[IMG]", "[IMG_BREAK]", "[IMG_END]"], "<s>", ["</s>"], "<pad>",
    _TEMPLATE,
)  # fmt: skip
IMAGE_SIZES = {"mistral3": 32}
_PATCH, _MERGE = 8, 2


def parts(name: str, tok: Any, vocab_size: int, image_size: int) -> tuple[Any, Any]:
    """`(config, processor)` of the tiny Mistral 3 model."""
    from transformers import Mistral3Config
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    from ..media.processor import pixtral_processor_class

    head_dim = HIDDEN // HEADS
    config = Mistral3Config(
        text_config=dict(
            model_type="mistral", vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
            num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=head_dim,
            max_position_embeddings=4096, sliding_window=None, pad_token_id=tok.pad_token_id,
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=False,
        ),
        vision_config=dict(
            model_type="pixtral", hidden_size=VISION_HIDDEN, intermediate_size=64, num_hidden_layers=VISION_LAYERS,
            num_attention_heads=VISION_HEADS, head_dim=VISION_HIDDEN // VISION_HEADS, image_size=image_size,
            patch_size=_PATCH,
        ),
        image_token_index=tok.convert_tokens_to_ids("[IMG]"), spatial_merge_size=_MERGE, vision_feature_layer=-1,
        tie_word_embeddings=False,
    )  # fmt: skip
    image_processor = PixtralImageProcessorPil(
        size={"longest_edge": image_size}, patch_size={"height": _PATCH, "width": _PATCH}, image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
    )  # fmt: skip
    processor = pixtral_processor_class()(
        image_processor=image_processor, tokenizer=tok, patch_size=_PATCH, spatial_merge_size=_MERGE,
        chat_template=tok.chat_template,
    )  # fmt: skip
    return config, processor
