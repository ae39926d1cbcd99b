"""`crop_image`: a box of an image, at the image's own resolution."""

from __future__ import annotations

from typing import Any

from PIL import Image

from .limits import MAX_PIXELS, check_size, pixel_box, source_box

__all__ = ["crop_image"]


def crop_image(
    image: Image.Image,
    x1: Any,
    y1: Any,
    x2: Any,
    y2: Any,
    max_pixels: int = MAX_PIXELS,
    source: Image.Image | None = None,
) -> Image.Image:
    """The box `(x1, y1)`-`(x2, y2)` of `image`, in its pixels (`vlm_grpo.tools.limits.pixel_box`: x right, y down,
    `x2`/`y2` exclusive). Raises `ValueError` for an empty box, one outside the image, or a result over `max_pixels`.
    `source`, the same picture at a higher resolution (before a pixel budget shrank `image`): the box is cut from it
    at its resolution, shrunk to `max_pixels` if over.

    >>> crop_image(Image.new("RGB", (64, 48)), 8, 0, 40, 16).size
    (32, 16)
    >>> crop_image(Image.new("RGB", (64, 48)), 8, 0, 40, 16, source=Image.new("RGB", (256, 192))).size
    (128, 64)
    """
    box = pixel_box(x1, y1, x2, y2, image.size)
    check_size(box[2] - box[0], box[3] - box[1], max_pixels, "crop")
    if source is None:
        return image.crop(box)
    out = source.crop(source_box(box, image.size, source.size))
    shrink = min(1.0, (max_pixels / (out.width * out.height)) ** 0.5)
    if shrink < 1.0:
        out = out.resize((max(1, int(out.width * shrink)), max(1, int(out.height * shrink))), Image.Resampling.BICUBIC)
    return out
