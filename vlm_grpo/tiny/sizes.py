"""The tiny models' dimensions: small enough that a GRPO step takes ~0.1 s on one CPU thread, big enough to learn a
4-way task."""

HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE = 64, 2, 4, 2, 128
VISION_HIDDEN, VISION_LAYERS, VISION_HEADS = 32, 2, 2
