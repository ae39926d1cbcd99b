"""Tiny GLM-4.1V (`glm4v`) and GLM-4.5V / 4.6V (`glm46v`, the same parts with a dense text model here): the real
architectures at tiny sizes, GLM's chat template and image tokens, the PIL image processor. Image geometry as Qwen2-VL:
patch 14, merge 2, so a 56x56 image is 2x2 merged patches = 4 image tokens; positions are GLM's 3-D rotary ones."""

from __future__ import annotations

from typing import Any

from .sizes import HEADS, HIDDEN, INTERMEDIATE, KV_HEADS, LAYERS, VISION_HEADS, VISION_HIDDEN, VISION_LAYERS
from .tokenizer import TokenizerSpec

__all__ = ["IMAGE_SIZES", "TOKENIZER", "parts"]

_TEMPLATE = (
    "[gMASK]<sop>{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}{% if item['type'] == 'image' %}"
    "<|begin_of_image|><|image|><|end_of_image|>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

TOKENIZER = TokenizerSpec(
    ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|begin_of_image|>",
     "<|end_of_image|>", "<|image|>", "<|begin_of_video|>", "<|end_of_video|>", "<|video|>"],
    None, ["<|endoftext|>", "<|user|>"], "<|endoftext|>", _TEMPLATE,
)  # fmt: skip
IMAGE_SIZES = {"glm4v": 56, "glm46v": 56}


def parts(name: str, tok: Any, vocab_size: int, image_size: int) -> tuple[Any, Any]:
    """`(config, processor)` of the tiny `name` model (`glm4v` or `glm46v`)."""
    from ..families import FAMILIES
    from ..media.processor import build_image_only_processor

    if name == "glm4v":
        from transformers import Glm4vConfig as Config
    else:
        from transformers import Glm46VConfig as Config
    ids = tok.convert_tokens_to_ids
    head_dim = HIDDEN // HEADS
    config = Config(
        text_config=dict(
            vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=4096,
            pad_token_id=tok.pad_token_id, eos_token_id=[ids("<|endoftext|>"), ids("<|user|>")],
            # half of head_dim is rotary: head_dim / 4 frequencies split over (time, height, width)
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                             "mrope_section": [head_dim // 4 - 2, 1, 1]},
        ),
        vision_config=dict(
            depth=VISION_LAYERS, hidden_size=VISION_HIDDEN, intermediate_size=64, num_heads=VISION_HEADS,
            image_size=image_size, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=HIDDEN,
        ),
        image_token_id=ids("<|image|>"), video_token_id=ids("<|video|>"), image_start_token_id=ids("<|begin_of_image|>"),
        image_end_token_id=ids("<|end_of_image|>"), video_start_token_id=ids("<|begin_of_video|>"),
        video_end_token_id=ids("<|end_of_video|>"), tie_word_embeddings=False,
    )  # fmt: skip
    unit = 28  # patch 14 x merge 2
    image_processor = FAMILIES[name].pil_image_processor_class()(
        size={"shortest_edge": unit * unit, "longest_edge": (4 * unit) ** 2}, patch_size=14, merge_size=2,
        temporal_patch_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
    )  # fmt: skip
    return config, build_image_only_processor(name, image_processor, tok, chat_template=tok.chat_template)
