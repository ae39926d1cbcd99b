"""What the image tools accept: boxes in the image's pixels, and a pixel budget for every image they return.

A tool that cannot do what it was asked raises `ValueError` with the reason and the fix; TRL's tool loop returns that
message to the model as `{"error": ...}` and counts the call as a failure (`tools/failure_frequency`). Nothing is
clamped or guessed: a box partly outside the image is refused, not cut to fit, so the model learns the frame.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MAX_PIXELS", "check_size", "pixel_box", "source_box", "to_number"]

# The largest image (width x height) a tool returns, one megapixel: tool images go back into the rollout, where the
# processor turns them into vision tokens counted against `max_completion_length`, and an absurd zoom would otherwise
# allocate gigabytes before the processor shrinks it again.
MAX_PIXELS = 1024 * 1024


def to_number(value: Any, name: str) -> float:
    """`value` as a float: tool-call arguments arrive as JSON numbers or, from templates that write them as text
    (Qwen3.5's `<parameter=...>`), as strings.

    >>> to_number("12", "x1"), to_number(3, "x1")
    (12.0, 3.0)
    """
    if isinstance(value, bool):  # a JSON `true` is not a coordinate, though Python would take it as 1
        raise ValueError(f"{name} must be a number, got {value!r}.")  # noqa: TRY004 (a bad value the model wrote)
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}.") from None


def pixel_box(x1: Any, y1: Any, x2: Any, y2: Any, size: tuple[int, int]) -> tuple[int, int, int, int]:
    """The box `(x1, y1)`-`(x2, y2)` in pixels of an image of `size` (width, height), rounded to whole pixels; raises
    `ValueError` for a box that is empty or reaches outside the image.

    The frame: x to the right, y down, (0, 0) the top-left corner, `(width, height)` the bottom-right one; `x2` and
    `y2` are exclusive, so the whole image is `(0, 0, width, height)`.

    >>> pixel_box(0, 0, 64, 32, (64, 48))
    (0, 0, 64, 32)
    >>> pixel_box(10, 10, 10, 20, (64, 48))
    Traceback (most recent call last):
    ...
    ValueError: The box (10, 10, 10, 20) is empty: x2 must be greater than x1 and y2 greater than y1.
    """
    box = tuple(round(to_number(v, n)) for v, n in zip((x1, y1, x2, y2), ("x1", "y1", "x2", "y2"), strict=True))
    width, height = size
    if box[2] <= box[0] or box[3] <= box[1]:
        raise ValueError(f"The box {box} is empty: x2 must be greater than x1 and y2 greater than y1.")
    if box[0] < 0 or box[1] < 0 or box[2] > width or box[3] > height:
        raise ValueError(
            f"The box {box} reaches outside the {width}x{height} image: coordinates are pixels, 0 <= x1 < x2 <= "
            f"{width} and 0 <= y1 < y2 <= {height}."
        )
    return box  # type: ignore[return-value]


def check_size(width: int, height: int, max_pixels: int, what: str) -> None:
    """Raise `ValueError` when a `width` x `height` result of `what` exceeds `max_pixels`.

    >>> check_size(2000, 2000, 1024 * 1024, "zoom")
    Traceback (most recent call last):
    ...
    ValueError: zoom would return a 2000x2000 image (4000000 pixels), over the tools' limit of 1048576 pixels (max_pixels): ask for a smaller box or factor.
    """
    if width * height > max_pixels:
        raise ValueError(
            f"{what} would return a {width}x{height} image ({width * height} pixels), over the tools' limit of "
            f"{max_pixels} pixels (max_pixels): ask for a smaller box or factor."
        )


def source_box(box: tuple[int, int, int, int], frame: tuple[int, int], source: tuple[int, int]) -> tuple[int, ...]:
    """`box` in pixels of an image of size `frame`, mapped onto the same picture at size `source` (the row's image
    before the pixel budget shrank it), rounded to whole pixels.

    >>> source_box((48, 48, 56, 56), (112, 112), (448, 448))
    (192, 192, 224, 224)
    """
    sx, sy = source[0] / frame[0], source[1] / frame[1]
    return tuple(round(v * s) for v, s in zip(box, (sx, sy, sx, sy), strict=True))
