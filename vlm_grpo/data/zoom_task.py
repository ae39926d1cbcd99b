"""The zoom tasks: a mark too small for the prompt's pixel budget, which `zoom` shows.

`zoom`: one small shape somewhere on a large plain canvas. What shape is it?

Made for image tools (`vlm-grpo --task zoom --tools zoom`, `vlm_grpo.tools`). The canvas is `ZOOM_IMAGE_SIZE` (448)
and the mark 8-12 px; under a pixel budget of 112 x 112 (tiny Qwen2.5-VL's whole budget, 4x4 merged patches) the
prompt's image keeps one pixel in 16 and the mark is 2-3 px wide, a fraction of one 14-px patch, while `zoom` on a box
around it cuts from the full canvas (the trainer keeps it for the tools) and returns it at 8-12 px or more. Its size
varies by half its side, so the mark's area (what a coarse view keeps best) does not give its kind away: a large
triangle covers as many pixels as a small square.

`zoom_color`: what colour is the dot at the centre of the canvas? The place is known, so the useful zoom is one call
(the centre eighth of the image, 8 times larger); what the model must learn is to make it and read the colour it
shows. The dot is 6 px on a 1024 px canvas, in two square rings whose colours cancel its colour at a distance (see
`_HALO`): a pixel budget that shrinks the canvas 8 times or more (128 x 128, 112 x 112, ...) averages the dot and its
rings into the plain background, so the prompt's image is the same, pixel for pixel, whatever the dot's colour.
Large shapes of the same colours lie around it (visible in the prompt, unrelated to the answer): they make every
picture different, and a model without the tool can do no better than guess.
"""

from __future__ import annotations

import random

from .example import Example, Redraw, retry
from .scene import BACKGROUND, COLORS, RGB, Shape, colors_for, place_boxes, px, random_box, shapes_for

__all__ = [
    "MIN_SIDE",
    "ZOOM_COLOR_IMAGE_SIZE",
    "ZOOM_COLOR_ZOOM",
    "ZOOM_IMAGE_SIZE",
    "centre_dot",
    "zoom_color_example",
    "zoom_example",
]

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


ZOOM_COLOR_IMAGE_SIZE = 1024  # the canvas `zoom_color` is made for: 8 times the tiny models' 128 px budget
#: The zoom that shows the centre dot: the centre eighth of the image's side, 8 times larger (the tools' largest
#: factor): at a 128 x 128 budget, `zoom(56, 56, 72, 72, factor=8)`, the canvas at its own resolution.
ZOOM_COLOR_ZOOM = 8
_DOT, _RING = 6 / 1024, 2 / 1024  # the dot's side and each ring's width, as fractions of the canvas
# Each ring's colour is the background plus this multiple of (dot colour - background): the inner ring nearly the
# dot's complement, the outer a faint echo of it. Fitted (least squares, through PIL's bicubic resize, the processors'
# own) so that the dot, the rings and the background average to the plain background at every pixel of the canvas
# shrunk 8 times, to within rounding: the dot's colour does not reach the prompt's image at all (tests/test_data.py
# checks it through the tiny processors' own resize to 128 and 112 px; 96 and 64 px gave the same when fitted). The
# dot must stay where it is: moved off the 8 px grid, it leaks up to 13 levels.
_HALO = (-0.859, 0.196)
_AROUND = ((0.05, 0.12), (2, 4))  # the shapes around the dot: side as fractions of the canvas, how many


def _tint(colour: RGB, weight: float) -> RGB:
    """The background moved `weight` times the way from it to `colour` (clipped to 0-255)."""
    return tuple(min(255, max(0, round(b + weight * (c - b)))) for c, b in zip(colour, BACKGROUND, strict=True))


@retry
def zoom_color_example(rng: random.Random, size: int, difficulty: int) -> Example:
    """A dot at the centre of the canvas in one of the difficulty's colours (the answer), in two rings that cancel its
    colour at the prompt's budget, among large shapes of the same colours. `extra["bbox"]` is the dot's box."""
    names = colors_for(difficulty)
    answer = rng.choice(names)
    items = []
    low, high = (px(f, size) for f in _AROUND[0])
    sides = [rng.randint(low, high) for _ in range(rng.randint(*_AROUND[1]))]
    # Clear of the centre quarter, which holds the zoom's box (the centre eighth) and all the bicubic kernel reaches.
    centre = (size * 3 // 8, size * 3 // 8, size * 5 // 8, size * 5 // 8)
    boxes = place_boxes(rng, size, [(s, s) for s in sides], [centre], gap=px(0.02, size))
    if boxes is None:
        raise Redraw
    for box in boxes:
        items.append(Shape(rng.choice(shapes_for(1)), COLORS[rng.choice(names)], box))
    items.extend(centre_dot(COLORS[answer], size))
    listed = f"{', '.join(names[:-1])} or {names[-1]}"
    question = f"What colour is the dot at the centre of the image? Zoom in to see it. Answer with one word: {listed}."
    return Example(tuple(items), question, answer, extra={"bbox": list(items[-1].box)})


def centre_dot(colour: RGB, size: int) -> tuple[Shape, Shape, Shape]:
    """`zoom_color`'s dot of `colour` at the centre of a `size` canvas in its two rings, as squares drawn in order
    (outer ring, inner ring, dot: each covers the middle of the one before); the dot's box is the last one's."""
    dot, ring = px(_DOT, size, 2), px(_RING, size)
    squares = []
    for width, weight in ((dot + 4 * ring, _HALO[1]), (dot + 2 * ring, _HALO[0]), (dot, 1.0)):
        start = (size - width) // 2
        squares.append(Shape("square", _tint(colour, weight), (start, start, start + width, start + width)))
    return squares[0], squares[1], squares[2]
