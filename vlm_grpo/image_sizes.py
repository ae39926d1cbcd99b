"""The sizes grounding rewards need: each row's image as the dataset holds it, and as the processor feeds it.

Qwen2.5-VL writes boxes in absolute pixels of the image *after* its processor resized it (``smart_resize`` to a
multiple of 28 within the pixel budget), while gold boxes are in the dataset image's pixels. The trainer knows both
sizes; :func:`add_image_sizes` puts them on every row, so they reach reward functions as the keyword columns
``source_image_size`` and ``fed_image_size`` (``(width, height)``, or None for a row without exactly one image or
a processor that does not resize by a pixel budget).
"""

from __future__ import annotations

import sys
from typing import Any

from .images import load_image, normalize_image
from .rows import row_images

__all__ = ["add_image_sizes", "fed_size"]


def fed_size(image_processor: Any, width: int, height: int) -> tuple[int, int] | None:
    """``(width, height)`` a Qwen-style image processor resizes a ``width`` x ``height`` image to, with its own
    ``smart_resize`` and settings; None for processors without one (Gemma 3, Idefics3)."""
    smart_resize = getattr(sys.modules.get(type(image_processor).__module__), "smart_resize", None)
    size = getattr(image_processor, "size", None)
    patch, merge = getattr(image_processor, "patch_size", None), getattr(image_processor, "merge_size", None)
    if smart_resize is None or size is None or not patch or not merge:
        return None
    min_pixels, max_pixels = size["shortest_edge"], size["longest_edge"]
    fed_height, fed_width = smart_resize(
        height, width, factor=patch * merge, min_pixels=min_pixels, max_pixels=max_pixels
    )
    return int(fed_width), int(fed_height)


def add_image_sizes(raw_rows: list[dict[str, Any]], prepared_rows: list[dict[str, Any]], processor: Any) -> list[dict]:
    """``prepared_rows`` with ``source_image_size`` (from ``raw_rows``) and ``fed_image_size`` added to each row."""
    image_processor = getattr(processor, "image_processor", None)
    out = []
    for raw, prepared in zip(raw_rows, prepared_rows, strict=True):
        raw_images, images = row_images(raw), row_images(prepared)
        source = fed = None
        if len(raw_images) == 1 and len(images) == 1:
            source = normalize_image(load_image(raw_images[0])).size  # EXIF-rotated, as annotations see it
            fed = fed_size(image_processor, *images[0].size) if image_processor is not None else None
        out.append({**prepared, "source_image_size": source, "fed_image_size": fed})
    return out
