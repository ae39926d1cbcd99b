"""`rotate_image`: an image turned about its centre."""

from __future__ import annotations

import math
from typing import Any

from PIL import Image

from .limits import MAX_PIXELS, check_size, to_number

__all__ = ["rotate_image"]


def rotate_image(image: Image.Image, degrees: Any, max_pixels: int = MAX_PIXELS) -> Image.Image:
    """`image` rotated `degrees` counter-clockwise, the canvas grown to hold all of it (corners filled black).
    Multiples of 90 are exact (no resampling). Raises `ValueError` for a result over `max_pixels`.

    >>> rotate_image(Image.new("RGB", (64, 48)), 90).size
    (48, 64)
    """
    angle = to_number(degrees, "degrees") % 360
    if angle % 90 == 0:
        quarter = {0: None, 90: Image.Transpose.ROTATE_90, 180: Image.Transpose.ROTATE_180,
                   270: Image.Transpose.ROTATE_270}[int(angle)]  # fmt: skip
        width, height = image.size if angle in (0, 180) else image.size[::-1]
        check_size(width, height, max_pixels, "rotate")
        return image.copy() if quarter is None else image.transpose(quarter)
    # The grown canvas checked before PIL allocates it (PIL rounds outwards: up to 2 pixels more), then as made.
    cos, sin = abs(math.cos(math.radians(angle))), abs(math.sin(math.radians(angle)))
    width, height = image.size
    check_size(math.ceil(width * cos + height * sin), math.ceil(width * sin + height * cos), max_pixels, "rotate")
    rotated = image.rotate(angle, resample=Image.Resampling.BICUBIC, expand=True)
    check_size(*rotated.size, max_pixels, "rotate")
    return rotated
