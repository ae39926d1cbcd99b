"""Scene primitives for the procedural tasks: palette, shapes, digits, placement, rendering.

A scene is a tuple of frozen items (filled shapes and digit glyphs), each with an
integer pixel box; :func:`render` draws it. The dataset builder assigns each rendered
image to the train or test split by a hash of its pixels
(:func:`vlm_grpo.data.dataset.split_of`), so two scenes that draw the same picture
always land in the same split.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

from PIL import Image, ImageDraw, ImageFont

RGB = tuple[int, int, int]
Box = tuple[int, int, int, int]  # (x1, y1, x2, y2); x2/y2 exclusive, like PIL's getbbox

# Mid-grey keeps every palette colour (including white) far from the background.
BACKGROUND: RGB = (128, 128, 128)
INK: RGB = (0, 0, 0)

# Ordered by difficulty: level 1 uses the first 4, level 2 the first 6, level 3 all.
# Pairwise RGB distances are >= 100 so no two colours can be confused.
COLORS: dict[str, RGB] = {
    "red": (220, 20, 20),
    "green": (30, 170, 50),
    "blue": (40, 70, 235),
    "yellow": (250, 230, 0),
    "purple": (150, 40, 190),
    "orange": (255, 128, 0),
    "cyan": (0, 215, 225),
    "white": (255, 255, 255),
}
_COLORS_PER_LEVEL = {1: 4, 2: 6, 3: 8}

SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "diamond")
_SHAPES_PER_LEVEL = {1: 3, 2: 3, 3: 4}


def colors_for(difficulty: int) -> list[str]:
    """Colour names in use at ``difficulty`` (1..3)."""
    return list(COLORS)[: _COLORS_PER_LEVEL[difficulty]]


def shapes_for(difficulty: int) -> list[str]:
    """Shape kinds in use at ``difficulty`` (1..3)."""
    return list(SHAPES[: _SHAPES_PER_LEVEL[difficulty]])


@dataclass(frozen=True)
class Shape:
    """A filled shape inscribed in ``box``."""

    kind: str
    color: RGB
    box: Box


@dataclass(frozen=True)
class Glyph:
    """Text (digits) drawn with PIL's default font, scaled to exactly fill ``box``."""

    text: str
    color: RGB
    box: Box


Item = Shape | Glyph


def px(fraction: float, image_size: int, minimum: int = 1) -> int:
    """``fraction`` of the image side in whole pixels, so layouts scale with the image."""
    return max(minimum, round(fraction * image_size))


def glyph_width(text: str, height: int) -> int:
    """Width in pixels of ``text`` rendered ``height`` pixels tall."""
    return _glyph_mask(text, height).width


@functools.lru_cache(maxsize=512)
def _glyph_mask(text: str, height: int) -> Image.Image:
    # Render big and downscale: the default font's native size is unreadable at
    # 56 px images, and cropping to the ink makes the box exactly the digit.
    font = ImageFont.load_default(size=96)
    probe = ImageDraw.Draw(Image.new("L", (1, 1)))
    left, top, right, bottom = probe.textbbox((0, 0), text, font=font)
    canvas = Image.new("L", (right - left + 4, bottom - top + 4), 0)
    ImageDraw.Draw(canvas).text((2 - left, 2 - top), text, fill=255, font=font)
    ink = canvas.crop(canvas.getbbox())
    width = max(1, round(ink.width * height / ink.height))
    return ink.resize((width, height), Image.Resampling.LANCZOS)


def overlaps(a: Box, b: Box, gap: int = 0) -> bool:
    """Whether boxes ``a`` and ``b`` come closer than ``gap`` pixels."""
    return not (a[2] + gap <= b[0] or b[2] + gap <= a[0] or a[3] + gap <= b[1] or b[3] + gap <= a[1])


def random_box(rng: random.Random, image_size: int, width: int, height: int, margin: int = 0) -> Box:
    """A uniformly placed ``width`` x ``height`` box at least ``margin`` pixels inside the image."""
    x1 = rng.randint(margin, max(margin, image_size - width - margin))
    y1 = rng.randint(margin, max(margin, image_size - height - margin))
    return (x1, y1, x1 + width, y1 + height)


def place_boxes(
    rng: random.Random,
    image_size: int,
    sizes: list[tuple[int, int]],
    taken: list[Box],
    gap: int,
    tries: int = 200,
) -> list[Box] | None:
    """Place boxes of ``sizes`` at random, ``gap`` pixels clear of each other and ``taken``.

    Returns ``None`` when the image is too crowded, so callers can redraw the scene.
    """
    placed: list[Box] = []
    for width, height in sizes:
        for _ in range(tries):
            box = random_box(rng, image_size, width, height)
            if not any(overlaps(box, other, gap) for other in taken + placed):
                placed.append(box)
                break
        else:
            return None
    return placed


def render(items: tuple[Item, ...], image_size: int) -> Image.Image:
    """Draw ``items`` in order on a plain background; returns a square RGB image."""
    img = Image.new("RGB", (image_size, image_size), BACKGROUND)
    draw = ImageDraw.Draw(img)
    for item in items:
        if isinstance(item, Glyph):
            img.paste(item.color, item.box[:2], _glyph_mask(item.text, item.box[3] - item.box[1]))
        else:
            draw_shape(draw, item)
    return img


def draw_shape(draw: ImageDraw.ImageDraw, shape: Shape, fill: int | RGB | None = None) -> None:
    """Draw ``shape`` filled with ``fill`` (default: its colour), touching all four box edges."""
    x1, y1, x2, y2 = shape.box
    right, bottom = x2 - 1, y2 - 1  # PIL's drawing coordinates are inclusive
    mid_x, mid_y = (x1 + right) / 2, (y1 + bottom) / 2
    colour = shape.color if fill is None else fill
    if shape.kind == "square":
        draw.rectangle((x1, y1, right, bottom), fill=colour)
    elif shape.kind == "circle":
        draw.ellipse((x1, y1, right, bottom), fill=colour)
    elif shape.kind == "triangle":
        draw.polygon([(x1, bottom), (right, bottom), (mid_x, y1)], fill=colour)
    elif shape.kind == "diamond":
        draw.polygon([(mid_x, y1), (right, mid_y), (mid_x, bottom), (x1, mid_y)], fill=colour)
    else:
        raise ValueError(f"unknown shape kind {shape.kind!r}; expected one of {SHAPES}")


def ink_bbox(shape: Shape, image_size: int) -> Box:
    """Tight box of the pixels ``shape`` actually covers (x2/y2 exclusive)."""
    mask = Image.new("L", (image_size, image_size), 0)
    draw_shape(ImageDraw.Draw(mask), shape, fill=255)
    bbox = mask.getbbox()
    assert bbox is not None, f"shape {shape} drew no pixels"
    return bbox
