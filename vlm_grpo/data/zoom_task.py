"""The `zoom` task: one small shape somewhere on a large plain canvas. What shape is it?

Made for image tools (`vlm-grpo --task zoom --tools zoom`, `vlm_grpo.tools`). The canvas is `ZOOM_IMAGE_SIZE` (448)
and the mark 8-12 px; under a pixel budget of 112 x 112 (tiny Qwen2.5-VL's whole budget, 4x4 merged patches) the
prompt's image keeps one pixel in 16 and the mark is 2-3 px wide, a fraction of one 14-px patch, while `zoom` on a box
around it cuts from the full canvas (the trainer keeps it for the tools) and returns it at 8-12 px or more. Its size
varies by half its side, so the mark's area (what a coarse view keeps best) does not give its kind away: a large
triangle covers as many pixels as a small square.
"""

from __future__ import annotations

import random

from .example import Example, retry
from .scene import COLORS, Shape, colors_for, px, random_box, shapes_for

__all__ = ["MIN_SIDE", "ZOOM_IMAGE_SIZE", "zoom_example"]

ZOOM_IMAGE_SIZE = 448  # the canvas the task is made for (its default --image_size)
MIN_SIDE = 6  # px: below this a circle, a square and a triangle draw nearly the same pixels, zoomed or not
# The mark's side, as fractions of the canvas, per difficulty (8-12 px at 448 on level 1): the largest is 1.5x the
# smallest, so a triangle's area (half its box) overlaps a square's.
_SIDE = {1: (0.018, 0.027), 2: (0.016, 0.024), 3: (0.014, 0.021)}


@retry
def zoom_example(rng: random.Random, size: int, difficulty: int) -> Example:
    """One small mark of a random colour anywhere on the canvas; the answer is its kind. `extra["bbox"]` is its box
    (x1, y1, x2, y2), for tests and for a forced or demonstrated zoom."""
    kinds = shapes_for(difficulty)  # the answers: the shape names of this difficulty
    kind = rng.choice(kinds)
    low, high = _SIDE[difficulty]
    side = rng.randint(px(low, size, MIN_SIDE), max(px(high, size, MIN_SIDE), px(low, size, MIN_SIDE)))
    box = random_box(rng, size, side, side)
    mark = Shape(kind, COLORS[rng.choice(colors_for(difficulty))], box)
    names = f"{', '.join(kinds[:-1])} or {kinds[-1]}"
    question = f"What shape is the small mark? Zoom in to see it. Answer with one word: {names}."
    return Example((mark,), question, kind, extra={"bbox": list(box)})
