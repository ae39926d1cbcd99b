"""Tiny Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5 (dense and MoE): the real architectures at tiny sizes, Qwen's chat template and special
tokens, the PIL image processor and `vlm_grpo.media.video_processor.QwenVideoProcessorPil`.

Image geometry: patch 14 (Qwen3-VL, Qwen3.5: 16), merge 2, so a 56x56 (64x64) image is 2x2 merged patches = 4 image tokens.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from .sizes import HEADS, HIDDEN, INTERMEDIATE, KV_HEADS, LAYERS, VISION_HEADS, VISION_HIDDEN, VISION_LAYERS
from .tokenizer import TokenizerSpec

__all__ = ["IMAGE_SIZES", "TOKENIZER", "build_image_processor", "parts", "tool_tokenizer"]

_QWEN_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_QWEN_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|image_pad|>", "<|video_pad|>",
]  # fmt: skip

TOKENIZER = TokenizerSpec(_QWEN_TOKENS, None, ["<|im_end|>", "<|endoftext|>"], "<|endoftext|>", _QWEN_TEMPLATE)
# Added, not special, in the real tokenizers: a decoded completion keeps its tool calls.
_TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
# The chat template each family ships, by its name in `trl.chat_template_utils`, which keeps the real templates to
# recognise them (`add_response_schema`). Qwen2-VL and Qwen2.5-VL ship one without tools; small Qwen3.5 models ship
# the no-thinking variant, the MoE the thinking one.
_SHIPPED_TEMPLATES = {
    "qwen2_vl": "qwen2_5_vl_chat_template", "qwen2_5_vl": "qwen2_5_vl_chat_template",
    "qwen3_vl": "qwen3_vl_chat_template", "qwen3_vl_moe": "qwen3_vl_chat_template",
    "qwen3_5": "qwen3_5_nothink_chat_template",
    "qwen3_5_moe": "qwen3_5_think_chat_template",
}  # fmt: skip
IMAGE_SIZES = {"qwen2_vl": 56, "qwen2_5_vl": 56, "qwen3_vl": 64, "qwen3_vl_moe": 64, "qwen3_5": 64, "qwen3_5_moe": 64}
# Qwen3.5's text model: a gated delta-rule (linear attention) layer, then a full-attention one (the real models
# repeat three linear layers and one full one).
_QWEN3_5_LAYERS = ["linear_attention", "full_attention", "linear_attention", "full_attention"]


def tool_tokenizer(name: str) -> TokenizerSpec:
    """The tokenizer spec of a tiny `name` model for tool calling: the family's shipped chat template (as TRL keeps
    it) and Qwen's tool tokens."""
    from trl import chat_template_utils

    template = getattr(chat_template_utils, _SHIPPED_TEMPLATES[name], None)
    if template is None:
        raise ValueError(f"This TRL has no copy of {name}'s chat template ({_SHIPPED_TEMPLATES[name]}); upgrade TRL.")
    return replace(TOKENIZER, chat_template=template, added=list(_TOOL_TOKENS))


def parts(name: str, tok: Any, vocab_size: int, image_size: int) -> tuple[Any, Any]:
    """`(config, processor)` of the tiny `name` model."""
    return _qwen_config(name, tok, vocab_size), _qwen_processor(name, tok, image_size)


def _qwen_config(name: str, tok, vocab_size: int):
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig

    ids = {
        "image_token_id": tok.convert_tokens_to_ids("<|image_pad|>"),
        "video_token_id": tok.convert_tokens_to_ids("<|video_pad|>"),
        "vision_start_token_id": tok.convert_tokens_to_ids("<|vision_start|>"),
        "vision_end_token_id": tok.convert_tokens_to_ids("<|vision_end|>"),
    }
    head_dim = HIDDEN // HEADS
    text = dict(
        vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=4096,
        head_dim=head_dim, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.pad_token_id, bos_token_id=None, tie_word_embeddings=False,
    )  # fmt: skip
    # mrope splits head_dim/2 rotary frequencies over (time, height, width); the sections must sum to head_dim/2.
    half = head_dim // 2
    mrope = [half - 2 * (half // 3), half // 3, half // 3]
    vision = dict(depth=VISION_LAYERS, hidden_size=VISION_HIDDEN, num_heads=VISION_HEADS, out_hidden_size=HIDDEN)
    if name in ("qwen3_5", "qwen3_5_moe"):
        return _qwen3_5_config(name, text, vision, ids)
    if name in ("qwen3_vl", "qwen3_vl_moe"):
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": mrope,
                                   "mrope_interleaved": True}  # fmt: skip
        vision.update(intermediate_size=64, patch_size=16, num_position_embeddings=16, deepstack_visual_indexes=[0])
        if name == "qwen3_vl_moe":  # every layer's MLP routed over 4 experts, 2 per token, as Qwen3-VL-30B-A3B
            from transformers import Qwen3VLMoeConfig

            text.update(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1)
            return Qwen3VLMoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
        return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": mrope}
    if name == "qwen2_5_vl":
        vision.update(intermediate_size=64, patch_size=14, window_size=112, fullatt_block_indexes=[1])
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
    vision = dict(depth=VISION_LAYERS, embed_dim=VISION_HIDDEN, num_heads=VISION_HEADS, hidden_size=HIDDEN,
                  mlp_ratio=2, patch_size=14)  # fmt: skip
    return Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)


def _qwen3_5_config(name: str, text: dict, vision: dict, ids: dict) -> Any:
    """Qwen3.5 (dense, or with routed experts): linear-attention layers (conv and recurrent state) beside full ones;
    the rotary part of each head split over (time, height, width), interleaved; a vision tower without deepstack."""
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig

    head_dim = 32  # a quarter of it rotary: 8 dims, 4 frequencies split 2 + 1 + 1
    text.update(
        head_dim=head_dim, num_hidden_layers=len(_QWEN3_5_LAYERS), layer_types=list(_QWEN3_5_LAYERS),
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    )  # fmt: skip
    vision.update(intermediate_size=64, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                  num_position_embeddings=16)  # fmt: skip
    if name == "qwen3_5_moe":
        text.pop("intermediate_size")
        text.update(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
        return Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
    return Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)


def build_image_processor(name: str) -> Any:
    """The tiny `name` model's image processor, its pixel budget included (as on the Hub, it is the processor's):
    at most a 4x4 grid of merged patches, 128 x 128 pixels for Qwen3-VL and Qwen3.5 (16 px patches), 112 x 112 for
    Qwen2-VL and Qwen2.5-VL (14 px)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    patch = 16 if name in ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe") else 14
    unit = patch * 2
    return Qwen2VLImageProcessorPil(
        size={"shortest_edge": unit * unit, "longest_edge": (4 * unit) ** 2}, patch_size=patch, merge_size=2,
        temporal_patch_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
    )  # fmt: skip


def _qwen_processor(name: str, tok, image_size: int):
    from ..families import FAMILIES
    from ..media.video_processor import QwenVideoProcessorPil

    image_processor = build_image_processor(name)
    patch, unit = image_processor.patch_size, image_processor.patch_size * 2
    common = dict(patch_size=patch, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    # Video: at most a 2x2 grid of merged patches per frame (4 tokens per temporal step); Qwen3-VL's budget covers the
    # whole clip (frames x area), here 16 frames' worth.
    frames = 16 if FAMILIES[name].video_budget == "clip" else 1
    video_processor = QwenVideoProcessorPil(
        FAMILIES[name].video_processor,
        size={"shortest_edge": unit * unit * min(frames, 2), "longest_edge": frames * (2 * unit) ** 2}, **common,
    )  # fmt: skip
    from ..media.processor import (
        build_qwen_processor,  # one place knows how to do without torchvision's video processor
    )

    return build_qwen_processor(name, image_processor, tok, video_processor=video_processor)
