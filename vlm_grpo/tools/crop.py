"""`crop_image`: a box of an image, at the image's own resolution."""

from __future__ import annotations

from typing import Any

from PIL import Image

from .limits import MAX_PIXELS, check_size, pixel_box

__all__ = ["crop_image"]


def crop_image(image: Image.Image, x1: Any, y1: Any, x2: Any, y2: Any, max_pixels: int = MAX_PIXELS) -> Image.Image:
    """The box `(x1, y1)`-`(x2, y2)` of `image`, in its pixels (`vlm_grpo.tools.limits.pixel_box`: x right, y down,
    `x2`/`y2` exclusive). Raises `ValueError` for an empty box, one outside the image, or a result over `max_pixels`.

    >>> crop_image(Image.new("RGB", (64, 48)), 8, 0, 40, 16).size
    (32, 16)
    """
    box = pixel_box(x1, y1, x2, y2, image.size)
    check_size(box[2] - box[0], box[3] - box[1], max_pixels, "crop")
    return image.crop(box)
