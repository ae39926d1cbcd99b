"""Where a dataset row holds its media: the image and video columns, and a row's images and clips as lists.

A row's images are in `image` (one) or `images` (a list), its clips in `video` (one) or `videos` (a list); a dataset
with both columns of a kind is refused, as either could be meant. A row already prepared for a batch with clips
(`vlm_grpo.data.rows.prepare_row`) holds them in its prompt's content blocks instead.

Under any other name, a column is known to hold images by what it holds (`holds_images`): image file paths or URLs,
encoded image bytes, PIL images or `datasets`' `{"bytes", "path"}` dicts, one per row or a list; so a column called
`file`, `path` or `src` is found as surely as one called `image`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from PIL import Image

__all__ = [
    "IMAGE_COLUMNS",
    "IMAGE_LIKE_NAMES",
    "IMAGE_SUFFIXES",
    "VIDEO_COLUMNS",
    "column_media",
    "holds_images",
    "image_column",
    "is_chat",
    "is_image_url",
    "looks_like_image",
    "row_clips",
    "row_images",
    "video_column",
]

IMAGE_COLUMNS = ("image", "images")
VIDEO_COLUMNS = ("video", "videos")
# Column names that mean images: a column so named that holds none is more likely a mistake than text.
IMAGE_LIKE_NAMES = (
    "img", "imgs", "picture", "pictures", "photo", "photos", "pixel_values", "image_path", "image_paths", "image_file",
    "image_files", "image_bytes",
)  # fmt: skip
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff", ".gif")
# The first bytes of the encodings PIL reads most often: PNG, JPEG, GIF, BMP, TIFF (both byte orders), WebP (RIFF).
_IMAGE_MAGIC = (b"\x89PNG", b"\xff\xd8\xff", b"GIF8", b"BM", b"II*\x00", b"MM\x00*", b"RIFF")


def _a(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _one_column(columns: Iterable[str], names: tuple[str, str], kind: str) -> str | None:
    found = [c for c in names if c in set(columns)]
    if len(found) > 1:
        raise ValueError(
            f"The rows have both {_a(names[0])} `{names[0]}` and {_a(names[1])} `{names[1]}` column, and either could "
            f"be the one meant. Keep one (rename or remove the other): `{names[0]}` for one {kind} per row, "
            f"`{names[1]}` for a list."
        )
    return found[0] if found else None


def image_column(columns: Iterable[str]) -> str | None:
    """The column holding a row's images (`image` or `images`), None without one; both present is refused.

    >>> image_column(["prompt", "images", "answer"])
    'images'
    """
    return _one_column(columns, IMAGE_COLUMNS, "image")


def video_column(columns: Iterable[str]) -> str | None:
    """The column holding a row's clips (`video` or `videos`), None without one; both present is refused.

    >>> video_column(["prompt", "video", "answer"])
    'video'
    """
    return _one_column(columns, VIDEO_COLUMNS, "clip")


def is_chat(prompt: Any) -> bool:
    """Whether `prompt` is a list of chat messages (dicts with a `role`)."""
    return isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt)


def _blocks_media(row: dict[str, Any], kind: str) -> list[Any]:
    prompt = row.get("prompt")
    if not is_chat(prompt):
        return []
    return [part[kind] for m in prompt if isinstance(m.get("content"), list) for part in m["content"]
            if isinstance(part, dict) and part.get("type") == kind and kind in part]  # fmt: skip


def row_images(row: dict[str, Any]) -> list[Any]:
    """A row's images as a list: its `images` list (or one image there), its single `image`, the images placed in its
    prompt (a `prepare_row` result of a dataset with clips), or [] for a text-only row."""
    if "images" in row:
        # An `images` column may hold one image per row (a `datasets.Image` feature, its undecoded dict, a path):
        # `list()` of it would count a dict's keys or a path's characters as images.
        return column_media(row, "images")
    if "image" in row:
        value = row["image"]
        return [] if value is None else [value]
    return _blocks_media(row, "image")


def row_clips(row: dict[str, Any]) -> list[Any]:
    """A row's clips as a list: its `videos` list, its single `video`, the clips placed in its prompt (a
    `prepare_row` result), or []."""
    column = video_column(row)
    if column is None:
        return _blocks_media(row, "video")
    value = row[column]
    if value is None:
        return []
    return list(value) if column == "videos" else [value]


def is_image_url(value: Any) -> bool:
    """Whether `value` is an http(s) URL of an image file (by its suffix, a query string aside)."""
    if not isinstance(value, str) or not value.lower().startswith(("http://", "https://")):
        return False
    return value.split("?", 1)[0].split("#", 1)[0].lower().endswith(IMAGE_SUFFIXES)


def looks_like_image(value: Any) -> bool:
    """Whether one cell holds an image by what it is: a PIL image, `datasets`' `{"bytes", "path"}` dict, encoded
    image bytes (PNG, JPEG, GIF, BMP, TIFF, WebP), or a path or URL of an image file (by its suffix).

    >>> looks_like_image("img/000.jpg"), looks_like_image("a cat"), looks_like_image(b"\\x89PNG\\r\\n")
    (True, False, True)
    """
    if isinstance(value, Image.Image):
        return True
    if isinstance(value, dict):
        return {"bytes", "path"} <= set(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value[:4]).startswith(_IMAGE_MAGIC)
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if is_image_url(value):
        return True
    return isinstance(value, str) and "\n" not in value and value.strip().lower().endswith(IMAGE_SUFFIXES)


def holds_images(values: Iterable[Any]) -> bool:
    """Whether a column's values (a sample of its rows) hold images: every value that is not None is an image
    (`looks_like_image`) or a non-empty list of them, and at least one is."""
    seen = False
    for value in values:
        if value is None or isinstance(value, (list, tuple)) and not value:
            continue
        items = value if isinstance(value, (list, tuple)) else [value]
        if not all(looks_like_image(item) for item in items):
            return False
        seen = True
    return seen


def column_media(row: dict[str, Any], column: str) -> list[Any]:
    """The images (or clips) a row holds in `column`, whatever its name, as a list: one value, or a list of them."""
    value = row.get(column)
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]
