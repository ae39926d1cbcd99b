"""`zoom_image`: a box of an image, enlarged."""

from __future__ import annotations

from typing import Any

from PIL import Image

from .limits import MAX_PIXELS, check_size, pixel_box, source_box, to_number

__all__ = ["MAX_FACTOR", "zoom_image"]

# Beyond this an enlargement shows interpolation, not detail; the pixel budget usually binds first.
MAX_FACTOR = 8.0


def zoom_image(
    image: Image.Image,
    x1: Any,
    y1: Any,
    x2: Any,
    y2: Any,
    factor: Any = 2,
    max_pixels: int = MAX_PIXELS,
    source: Image.Image | None = None,
) -> Image.Image:
    """The box `(x1, y1)`-`(x2, y2)` of `image` (its pixels, as `crop_image`) enlarged `factor` times (bicubic).
    Raises `ValueError` for a bad box, a factor outside [1, `MAX_FACTOR`], or a result over `max_pixels`. `source`,
    the same picture at a higher resolution (before a pixel budget shrank `image`): the enlargement is resampled from
    it, showing the detail `image` lost.

    >>> zoom_image(Image.new("RGB", (64, 48)), 0, 0, 16, 8, factor=3).size
    (48, 24)
    """
    box = pixel_box(x1, y1, x2, y2, image.size)
    scale = to_number(factor, "factor")
    if not 1 <= scale <= MAX_FACTOR:
        raise ValueError(f"factor must be between 1 and {MAX_FACTOR:g}, got {scale:g}.")
    width, height = round((box[2] - box[0]) * scale), round((box[3] - box[1]) * scale)
    check_size(width, height, max_pixels, "zoom")
    picture = image if source is None else source
    return picture.crop(source_box(box, image.size, picture.size)).resize((width, height), Image.Resampling.BICUBIC)
