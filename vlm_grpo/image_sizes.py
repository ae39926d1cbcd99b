"""The sizes grounding rewards need: each row's image as the dataset holds it, and as the processor feeds it.

Qwen2.5-VL writes boxes in absolute pixels of the image *after* its processor resized it (``smart_resize`` to a
multiple of 28 within the pixel budget), while gold boxes are in the dataset image's pixels. The trainer knows both
sizes; :func:`add_image_sizes` puts them on every row, so they reach reward functions as the keyword columns
``source_image_size`` and ``fed_image_size`` (``(width, height)``, or None for a row without exactly one image or
a processor that does not resize by a pixel budget).
"""

from __future__ import annotations

from typing import Any

from .pixel_budget import fed_size
from .rows import row_images, source_image_sizes

__all__ = ["add_image_sizes"]


def add_image_sizes(rows: list[dict[str, Any]], processor: Any) -> list[dict[str, Any]]:
    """``rows`` (from ``prepare_row``) with ``source_image_size`` and ``fed_image_size`` added to each.

    Nothing is decoded again: the source size is the one ``prepare_row`` recorded (upright, as annotations see it),
    the fed size is the processor's resize of the image ``prepare_row`` produced.
    """
    image_processor = getattr(processor, "image_processor", None)
    out = []
    for row in rows:
        images, sources = row_images(row), source_image_sizes(row)
        source = fed = None
        if len(images) == 1 and sources:
            source = sources[0]
            fed = fed_size(image_processor, *images[0].size) if image_processor is not None else None
        out.append({**row, "source_image_size": source, "fed_image_size": fed})
    return out
