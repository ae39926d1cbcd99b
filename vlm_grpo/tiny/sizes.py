"""The tiny models' dimensions: small enough that a GRPO step takes ~0.1 s on one CPU thread, big enough to learn a
4-way task."""

from typing import Any

HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE = 64, 2, 4, 2, 128
VISION_HIDDEN, VISION_LAYERS, VISION_HEADS = 32, 2, 2


def text_config(model_type: str, tok: Any, vocab_size: int, eos: str) -> dict[str, Any]:
    """A tiny decoder's config arguments: these sizes, padding from `tok`, `eos` (a token) as EOS, no BOS, untied."""
    return dict(
        model_type=model_type, vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=4096,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.convert_tokens_to_ids(eos), bos_token_id=None,
        tie_word_embeddings=False,
    )  # fmt: skip
