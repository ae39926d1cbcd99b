"""Procedural visual-reasoning tasks: each samples a scene, a question and its answer.

Generators take ``(rng, image_size, difficulty)`` and return an :class:`Example`
of plain data; rendering happens later in :mod:`vlm_grpo.data.dataset`. All
geometry is a fraction of ``image_size`` so tasks read the same at 56 px and 448 px.
Answers are sampled first (uniformly) and scenes built to match, which keeps the
answer distribution flat.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from .example import Example, Redraw, retry
from .scene import (
    COLORS,
    INK,
    Box,
    Glyph,
    Item,
    Shape,
    colors_for,
    glyph_width,
    ink_bbox,
    overlaps,
    place_boxes,
    px,
    random_box,
    shapes_for,
)
from .zoom_task import ZOOM_COLOR_IMAGE_SIZE, ZOOM_COLOR_ZOOM, ZOOM_IMAGE_SIZE, zoom_color_example, zoom_example

DIFFICULTIES = (1, 2, 3)
_DIRECTIONS = ("left", "right")
_RELATIONS = ("left", "right", "above", "below")
_POSITIONS = ("left", "middle", "right")
_MAX_COUNT = {1: 4, 2: 5, 3: 6}
_MAX_DIGIT = {1: 4, 2: 9, 3: 9}


def _plural(kind: str) -> str:
    return kind + "s"


def _placed(rng: random.Random, size: int, sides: list[int], taken: list[Box], gap: int) -> list[Box]:
    boxes = place_boxes(rng, size, [(s, s) for s in sides], taken, gap)
    if boxes is None:
        raise Redraw
    return boxes


# ------------------------------------------------------------------------ color


@retry
def _color(rng: random.Random, size: int, difficulty: int) -> Example:
    """One large filled shape; chance level is 1 / number of colours (0.25 at level 1)."""
    low, high, margin = {1: (0.45, 0.7, 0.08), 2: (0.35, 0.6, 0.05), 3: (0.2, 0.5, 0.0)}[difficulty]
    side = rng.randint(px(low, size, 3), px(high, size, 3))
    color = rng.choice(colors_for(difficulty))
    box = random_box(rng, size, side, side, px(margin, size, 0))
    shape = Shape(rng.choice(shapes_for(difficulty)), COLORS[color], box)
    return Example((shape,), "What colour is the shape? Answer with one word.", color)


# ------------------------------------------------------------------------ count


@retry
def _count(rng: random.Random, size: int, difficulty: int) -> Example:
    """Shapes on a jittered grid; count those of one colour (and, at level 3, one kind)."""
    count = rng.randint(0 if difficulty > 1 else 1, _MAX_COUNT[difficulty])
    colors, kinds = colors_for(difficulty), shapes_for(difficulty)
    color = rng.choice(colors)
    kind = rng.choice(kinds) if difficulty == 3 else None
    n_distractors = {1: 0, 2: rng.randint(1, 3), 3: rng.randint(2, 5)}[difficulty]

    targets = [(color, kind or rng.choice(kinds)) for _ in range(count)]
    distractors = []
    for _ in range(n_distractors):
        if kind is None:  # colour alone defines the target, so any other colour is safe
            distractors.append((rng.choice([c for c in colors if c != color]), rng.choice(kinds)))
        elif rng.random() < 0.5:  # same colour, other kind
            distractors.append((color, rng.choice([k for k in kinds if k != kind])))
        else:  # same kind, other colour
            distractors.append((rng.choice([c for c in colors if c != color]), kind))

    # A grid with a 2 px gutter keeps every object a separate blob, which
    # random placement cannot guarantee when the image is crowded.
    grid = 4 if difficulty < 3 else 5
    cell = size // grid
    offset = (size - cell * grid) // 2
    cells = rng.sample(range(grid * grid), len(targets) + len(distractors))
    items = []
    for (name, shape_kind), index in zip(targets + distractors, cells, strict=True):
        side = rng.randint(min(px(0.55, cell), cell - 2), cell - 2)
        x1 = offset + (index % grid) * cell + rng.randint(1, cell - side - 1)
        y1 = offset + (index // grid) * cell + rng.randint(1, cell - side - 1)
        items.append(Shape(shape_kind, COLORS[name], (x1, y1, x1 + side, y1 + side)))

    noun = f"{color} {_plural(kind)}" if kind else f"{color} shapes"
    return Example(tuple(items), f"How many {noun} are there? Answer with a number.", str(count))


# ---------------------------------------------------------------------- spatial


def _relation(a: Box, b: Box) -> str | None:
    """Where ``a`` is relative to ``b``, or None when neither axis clearly dominates."""
    dx = (a[0] + a[2] - b[0] - b[2]) / 2
    dy = (a[1] + a[3] - b[1] - b[3]) / 2
    if abs(dx) >= 2 * abs(dy):
        return "left" if dx < 0 else "right"
    if abs(dy) >= 2 * abs(dx):
        return "above" if dy < 0 else "below"
    return None


@retry
def _spatial(rng: random.Random, size: int, difficulty: int) -> Example:
    """Two named shapes in a clear left/right/above/below relation, plus distractors."""
    relation = rng.choice(_RELATIONS)
    colors, kinds = colors_for(difficulty), shapes_for(difficulty)
    first, second = ("red", "blue") if difficulty == 1 else rng.sample(colors, 2)
    low, high = {1: (0.25, 0.35), 2: (0.2, 0.3), 3: (0.15, 0.25)}[difficulty]
    sides = [rng.randint(px(low, size, 3), px(high, size, 3)) for _ in range(2)]
    gap = px(0.05, size, 1)
    for _ in range(500):
        a = random_box(rng, size, sides[0], sides[0])
        b = random_box(rng, size, sides[1], sides[1])
        if not overlaps(a, b, gap) and _relation(a, b) == relation:
            break
    else:
        raise Redraw
    items = [
        Shape(rng.choice(kinds), COLORS[first], a),
        Shape(rng.choice(kinds), COLORS[second], b),
    ]

    n_distractors = {1: 0, 2: 1, 3: rng.randint(2, 3)}[difficulty]
    others = [c for c in colors if c not in (first, second)]
    d_sides = [rng.randint(px(low, size, 3), px(high, size, 3)) for _ in range(n_distractors)]
    for box in _placed(rng, size, d_sides, [a, b], gap):
        items.append(Shape(rng.choice(kinds), COLORS[rng.choice(others)], box))

    question = (
        f"Where is the {first} shape relative to the {second} shape? Answer with one word: left, right, above or below."
    )
    return Example(tuple(items), question, relation)


# ------------------------------------------------------------------- arithmetic


@retry
def _arithmetic(rng: random.Random, size: int, difficulty: int) -> Example:
    """Two digits, one per image half, drawn large with PIL's default font; answer their sum."""
    top = _MAX_DIGIT[difficulty]
    total = rng.randint(0, 2 * top)
    left = rng.randint(max(0, total - top), min(top, total))
    digits = (str(left), str(total - left))
    low, high = (0.4, 0.55) if difficulty < 3 else (0.3, 0.45)
    half = size // 2
    items: list[Item] = []
    for i, text in enumerate(digits):
        height = rng.randint(px(low, size, 5), px(high, size, 5))
        width = glyph_width(text, height)
        margin = px(0.04, size, 1)
        x_lo, x_hi = i * half + margin, (i + 1) * half - width - margin
        if x_hi < x_lo:
            raise Redraw
        x1 = rng.randint(x_lo, x_hi)
        y1 = rng.randint(margin, size - height - margin)
        color = INK if difficulty < 3 else COLORS[rng.choice(colors_for(3))]
        items.append(Glyph(text, color, (x1, y1, x1 + width, y1 + height)))

    if difficulty == 3:  # small shapes as clutter that must be ignored
        sides = [px(0.1, size, 3) for _ in range(rng.randint(1, 2))]
        for box in _placed(rng, size, sides, [it.box for it in items], px(0.03, size, 1)):
            items.append(Shape(rng.choice(shapes_for(3)), COLORS[rng.choice(colors_for(3))], box))

    question = "What is the sum of the two digits in the image? Answer with a number."
    return Example(tuple(items), question, str(total))


# ----------------------------------------------------------------------- locate


@retry
def _locate(rng: random.Random, size: int, difficulty: int) -> Example:
    """Bounding box of the one shape with a named colour and kind, among distractors."""
    colors, kinds = colors_for(difficulty), shapes_for(difficulty)
    color, kind = rng.choice(colors), rng.choice(kinds)
    low, high = {1: (0.25, 0.45), 2: (0.2, 0.4), 3: (0.15, 0.35)}[difficulty]
    n_distractors = {1: 0, 2: rng.randint(1, 2), 3: rng.randint(2, 4)}[difficulty]
    other_colors = [c for c in colors if c != color]
    other_kinds = [k for k in kinds if k != kind]

    specs = [(color, kind)]
    for _ in range(n_distractors):
        if difficulty == 2:  # differs in both attributes
            specs.append((rng.choice(other_colors), rng.choice(other_kinds)))
        elif rng.random() < 0.5:  # level 3: shares exactly one attribute
            specs.append((color, rng.choice(other_kinds)))
        else:
            specs.append((rng.choice(other_colors), kind))
    sides = [rng.randint(px(low, size, 3), px(high, size, 3)) for _ in specs]
    boxes = _placed(rng, size, sides, [], px(0.04, size, 1))
    items = tuple(Shape(k, COLORS[c], box) for (c, k), box in zip(specs, boxes, strict=True))

    bbox = ink_bbox(items[0], size)
    question = (
        f"Where is the {color} {kind}? Answer with its bounding box as [x1, y1, x2, y2] "
        f"in pixel coordinates of the {size}x{size} image."
    )
    answer = "[" + ", ".join(str(v) for v in bbox) + "]"
    extra = {"bbox": [float(v) for v in bbox], "image_size": [size, size]}
    return Example(items, question, answer, extra)


# --------------------------------------------------------------------- position


@retry
def _position(rng: random.Random, size: int, difficulty: int) -> Example:
    """A single dot in the left, middle or right third of the image."""
    answer = rng.choice(_POSITIONS)
    radius, margin = {1: (0.1, 0.03), 2: (0.07, 0.02), 3: (0.04, 0.0)}[difficulty]
    side = px(2 * radius, size, 2)
    third = _POSITIONS.index(answer)
    zone_lo, zone_hi = size * third / 3, size * (third + 1) / 3
    # The whole dot stays inside its third (plus a margin at easy levels), so
    # the answer never depends on which pixel counts as the dot's centre.
    x_lo, x_hi = _int_range(zone_lo + px(margin, size, 0), zone_hi - px(margin, size, 0) - side)
    if x_hi < x_lo:
        x_lo, x_hi = _int_range(zone_lo, zone_hi - side)
    x1 = rng.randint(x_lo, x_hi)
    y1 = rng.randint(0, size - side)
    color = COLORS[rng.choice(colors_for(difficulty))]
    dot = Shape("circle", color, (x1, y1, x1 + side, y1 + side))
    question = "Is the dot on the left, in the middle or on the right? Answer with one word: left, middle or right."
    return Example((dot,), question, answer)


# ----------------------------------------------------------------------- motion

MOTION_FRAMES = 4  # two of Qwen-VL's temporal steps (it pairs frames)


@retry
def _motion(rng: random.Random, size: int, difficulty: int) -> Example:
    """A clip of one shape sliding left or right across the frames (a video task: `Example.frames`).

    The path starts anywhere it fits, so where the shape is in one frame says little on its own: the answer is in the
    change between frames. Harder levels use smaller shapes and shorter moves, and add still distractors.
    """
    answer = rng.choice(_DIRECTIONS)
    side_frac, travel_frac = {1: (0.3, 0.45), 2: (0.22, 0.35), 3: (0.16, 0.3)}[difficulty]
    side, travel = px(side_frac, size, 3), px(travel_frac, size, 2)
    kinds = shapes_for(difficulty)
    color = rng.choice(colors_for(difficulty))
    x_start = rng.randint(0, size - side - travel)
    y = rng.randint(0, size - side)
    xs = [x_start + round(travel * t / (MOTION_FRAMES - 1)) for t in range(MOTION_FRAMES)]
    if answer == "left":
        xs.reverse()
    kind = rng.choice(kinds)
    path = (min(xs), y, max(xs) + side, y + side)
    still: list[Item] = []
    if difficulty == 3:  # shapes that do not move, clear of the moving one's path
        others = [c for c in colors_for(3) if c != color]
        sides = [px(0.12, size, 3) for _ in range(rng.randint(1, 2))]
        for box in _placed(rng, size, sides, [path], px(0.03, size, 1)):
            still.append(Shape(rng.choice(kinds), COLORS[rng.choice(others)], box))
    frames = tuple((*still, Shape(kind, COLORS[color], (x, y, x + side, y + side))) for x in xs)
    question = "Which way does the shape move? Answer with one word: left or right."
    return Example(frames[0], question, answer, frames=frames)


@retry
def _color_change(rng: random.Random, size: int, difficulty: int) -> Example:
    """A clip of one shape that turns from one colour to another: what colour is it at the end? (a video task).

    Both colours are in the clip, so reading the colours is not enough: the answer is the later one. At level 1 the
    change falls between Qwen-VL's two temporal steps (frames 0-1, 2-3); at higher levels on any frame after the
    first, and the shape moves a little.
    """
    colors = colors_for(difficulty)
    before, after = rng.sample(colors, 2)
    low, high = {1: (0.45, 0.7), 2: (0.35, 0.6), 3: (0.25, 0.5)}[difficulty]
    side = rng.randint(px(low, size, 3), px(high, size, 3))
    kind = rng.choice(shapes_for(difficulty))
    change = 2 if difficulty == 1 else rng.randint(1, MOTION_FRAMES - 1)
    box = random_box(rng, size, side, side)
    frames = []
    for t in range(MOTION_FRAMES):
        if difficulty > 1 and t:
            box = random_box(rng, size, side, side)
        frames.append((Shape(kind, COLORS[before if t < change else after], box),))
    question = "The shape changes colour. What colour is it at the end? Answer with one word."
    return Example(frames[0], question, after, frames=tuple(frames))


def _int_range(lo: float, hi: float) -> tuple[int, int]:
    return -int(-lo // 1), int(hi // 1)


# --------------------------------------------------------------------- registry


def _number_words(lo: int, hi: int) -> list[str]:
    return [str(i) for i in range(lo, hi + 1)]


@dataclass(frozen=True)
class TaskSpec:
    """A task's scene sampler and the answer vocabulary it can produce."""

    generate: Callable[[random.Random, int, int], Example]
    words: Callable[[int, int], list[str]]  # (difficulty, image_size) -> answer words
    video: bool = False  # its rows hold a clip (`video`), not an image
    image_size: int = 56  # the canvas it is made for: make_visual_reasoning_dataset's default for it
    # Made for image tools: its rows hold the mark's `bbox`, and a zoom this many times on a box of 1 / zoom of the
    # image's side around it shows what the prompt's image cannot (`vlm_grpo.tools.warm_start`'s traces). None: not.
    zoom: int | None = None


TASK_SPECS: dict[str, TaskSpec] = {
    "color": TaskSpec(_color, lambda d, s: colors_for(d)),
    "count": TaskSpec(_count, lambda d, s: _number_words(0 if d > 1 else 1, _MAX_COUNT[d])),
    "spatial": TaskSpec(_spatial, lambda d, s: list(_RELATIONS)),
    "arithmetic": TaskSpec(_arithmetic, lambda d, s: _number_words(0, 2 * _MAX_DIGIT[d])),
    # Locate answers look like "[3, 10, 25, 31]": numbers plus punctuation tokens.
    "locate": TaskSpec(_locate, lambda d, s: ["[", ",", "]", *_number_words(0, s)]),
    "position": TaskSpec(_position, lambda d, s: list(_POSITIONS)),
    "motion": TaskSpec(_motion, lambda d, s: list(_DIRECTIONS), video=True),
    "color_change": TaskSpec(_color_change, lambda d, s: colors_for(d), video=True),
    # A small mark on a large canvas, for image tools (`--tools zoom`): vlm_grpo.data.zoom_task.
    "zoom": TaskSpec(zoom_example, lambda d, s: shapes_for(d), image_size=ZOOM_IMAGE_SIZE, zoom=4),
    # The colour of a dot at the centre, invisible at the prompt's budget: one known zoom shows it.
    "zoom_color": TaskSpec(
        zoom_color_example, lambda d, s: colors_for(d), image_size=ZOOM_COLOR_IMAGE_SIZE, zoom=ZOOM_COLOR_ZOOM
    ),
}

TASKS: tuple[str, ...] = tuple(TASK_SPECS)
#: The tasks whose rows hold a clip (`video`: a list of frames) instead of an image.
VIDEO_TASKS: tuple[str, ...] = tuple(name for name, spec in TASK_SPECS.items() if spec.video)


def check_task(task: str) -> TaskSpec:
    """The spec for ``task``; raises ValueError listing the valid task names."""
    if task not in TASK_SPECS:
        raise ValueError(f"unknown task {task!r}; valid tasks: {', '.join(TASKS)}")
    return TASK_SPECS[task]


def check_difficulty(difficulty: int) -> None:
    """Raise ValueError unless ``difficulty`` is one of :data:`DIFFICULTIES`."""
    if isinstance(difficulty, bool) or difficulty not in DIFFICULTIES:
        raise ValueError(f"difficulty must be one of {DIFFICULTIES}, got {difficulty!r}")


def answer_words(task: str, difficulty: int = 3, *, image_size: int = 56) -> list[str]:
    """Every whitespace/punctuation-separated word ``task`` can answer with at ``difficulty``.

    Higher difficulties are supersets of lower ones, so the default (3) covers all
    levels. ``image_size`` only matters for ``"locate"``, whose answers are
    ``"[x1, y1, x2, y2]"`` made of the tokens ``[``, ``,``, ``]`` and the
    integers 0..image_size.

    Raises:
        ValueError: unknown task or difficulty.
    """
    spec = check_task(task)
    check_difficulty(difficulty)
    return spec.words(difficulty, image_size)
