"""Where a dataset row holds its media: the image and video columns, and a row's images and clips as lists.

A row's images are in `image` (one) or `images` (a list), its clips in `video` (one) or `videos` (a list); a dataset
with both columns of a kind is refused, as either could be meant. A row already prepared for a batch with clips
(`vlm_grpo.rows.prepare_row`) holds them in its prompt's content blocks instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["IMAGE_COLUMNS", "VIDEO_COLUMNS", "image_column", "is_chat", "row_clips", "row_images", "video_column"]

IMAGE_COLUMNS = ("image", "images")
VIDEO_COLUMNS = ("video", "videos")


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
    """A row's images as a list: its `images` list, its single `image`, the images placed in its prompt (a
    `prepare_row` result of a dataset with clips), or [] for a text-only row."""
    if "images" in row:
        value = row["images"]
        return [] if value is None else list(value)
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
