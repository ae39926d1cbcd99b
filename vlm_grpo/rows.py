"""Dataset rows -> what TRL's GRPO loop expects, with bad input caught before training starts.

`check_dataset` runs once, at trainer construction: structural problems (no rows, no image column
for prompts that have image placeholders, a placeholder count that differs from the row's images,
both `image` and `images` columns) raise a `ValueError` naming the row and the fix; unreadable or
truncated images drop their row, logged and counted, so a long run never dies on row 93 412.

`prepare_row` runs per batch: images normalised (RGB, EXIF, alpha on white, 16-bit...) and fitted
to the pixel budget, a plain-string prompt with images wrapped into a user message.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from .images import ImageError, load_image, prepare_images

__all__ = ["SkippedRows", "check_dataset", "count_image_placeholders", "prepare_row", "row_images"]

logger = logging.getLogger(__name__)

IMAGE_COLUMNS = ("image", "images")


@dataclass
class SkippedRows:
    """Rows dropped by `check_dataset`: their indices in the original dataset and why."""

    indices: list[int] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.indices)


def _is_chat(prompt: Any) -> bool:
    return isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt)


def count_image_placeholders(prompt: Any) -> int:
    """Number of `{"type": "image"}` content blocks in a chat prompt (0 for plain strings)."""
    if not _is_chat(prompt):
        return 0
    return sum(
        1
        for message in prompt
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if isinstance(part, dict) and part.get("type") == "image"
    )


def row_images(row: dict[str, Any]) -> list[Any]:
    """A row's images as a list: its `images` list, its single `image`, or [] for a text-only row."""
    if "images" in row:
        value = row["images"]
        return [] if value is None else list(value)
    value = row.get("image")
    return [] if value is None else [value]


# Markers that show a chat template was already applied to a string prompt; images cannot be placed then.
_TEMPLATE_MARKERS = ("<|im_start|>", "<start_of_turn>", "<|start_header_id|>", "<image>", "<|image_pad|>", "[INST]")


def _check_prompt(prompt: Any, n_images: int, index: int, name: str) -> None:
    if isinstance(prompt, str):
        if n_images and any(marker in prompt for marker in _TEMPLATE_MARKERS):
            raise ValueError(
                f"{name} row {index}: the prompt is a string with a chat template already applied, and the row has "
                f"{n_images} image(s). Images need chat-message prompts: pass the raw messages, e.g. "
                "[{'role': 'user', 'content': 'What colour is the shape?'}], and let the trainer apply the template."
            )
        return
    if not _is_chat(prompt):
        raise ValueError(
            f"{name} row {index}: `prompt` must be a string or a list of chat messages "
            f"({{'role': ..., 'content': ...}}), got {type(prompt).__name__}."
        )
    placeholders = count_image_placeholders(prompt)
    # String contents get the images put before the first user text (TRL); structured contents must place each.
    structured = any(isinstance(message.get("content"), list) for message in prompt)
    if (structured or placeholders) and placeholders != n_images:
        raise ValueError(
            f"{name} row {index}: the prompt has {placeholders} image placeholder(s) ({{'type': 'image'}}) but the "
            f"row has {n_images} image(s). Make them match, or give the messages plain-string contents and the "
            "images are put before the first user message."
        )


def check_dataset(
    dataset: Any, name: str = "train_dataset", *, check_images: bool = True, skip_bad_rows: bool = True
) -> tuple[Any, SkippedRows]:
    """Validate a dataset before training; return `(dataset, skipped)` with unreadable-image rows removed.

    Args:
        dataset: a `datasets.Dataset` (checked row by row) or an `IterableDataset` (only its columns are checked:
            it cannot be scanned without consuming it).
        name: used in messages (`train_dataset`, `eval_dataset`).
        check_images: decode every image once (catches truncated/corrupt files up front).
        skip_bad_rows: drop rows whose images cannot be read (logged, counted in `skipped`); False raises instead.
    """
    if dataset is None:
        return dataset, SkippedRows()
    columns = list(getattr(dataset, "column_names", None) or [])
    if columns and "prompt" not in columns:
        raise ValueError(f"{name} has no `prompt` column (columns: {columns}). Rename your question column to `prompt`.")
    if "image" in columns and "images" in columns:
        raise ValueError(f"{name} has both `image` and `images` columns; keep one (`images` for several per row).")
    if not hasattr(dataset, "__len__"):
        return dataset, SkippedRows()
    if len(dataset) == 0:
        raise ValueError(f"{name} is empty: GRPO needs at least one prompt.")

    image_column = next((c for c in IMAGE_COLUMNS if c in columns), None)
    raw = dataset
    if image_column is not None:
        # Read images undecoded ({"bytes", "path"}), so a corrupt file is our error to report, not a crash in datasets.
        from datasets import Image as ImageFeature
        from datasets import Sequence

        feature = dataset.features.get(image_column)
        if isinstance(feature, ImageFeature):
            raw = dataset.cast_column(image_column, ImageFeature(decode=False))
        elif isinstance(feature, Sequence) and isinstance(feature.feature, ImageFeature):
            raw = dataset.cast_column(image_column, Sequence(ImageFeature(decode=False)))
        elif isinstance(feature, list) and feature and isinstance(feature[0], ImageFeature):
            raw = dataset.cast_column(image_column, [ImageFeature(decode=False)])

    skipped = SkippedRows()
    read_columns = ["prompt"] + ([image_column] if image_column else [])
    for index, row in enumerate(raw.select_columns(read_columns)):
        images = row_images(row)
        if image_column is None and count_image_placeholders(row["prompt"]):
            raise ValueError(
                f"{name} row {index}: the prompt has image placeholders but the dataset has no `image` or `images` "
                f"column (columns: {columns}). Add the images as an `image` (one) or `images` (list) column."
            )
        _check_prompt(row["prompt"], len(images), index, name)
        if not check_images:
            continue
        for position, image in enumerate(images):
            if image is None:
                raise ValueError(f"{name} row {index}: image {position} is None; drop it from the row's `images` list.")
            try:
                load_image(image)
            except ImageError as error:
                if not skip_bad_rows:
                    raise ImageError(f"{name} row {index}, image {position}: {error}") from error
                skipped.indices.append(index)
                skipped.reasons.append(f"row {index}, image {position}: {error}")
                break
    if skipped:
        logger.warning(
            "%s: skipped %d of %d rows with unreadable images (set skip_bad_rows=False to raise instead). First: %s",
            name, len(skipped), len(dataset), "; ".join(skipped.reasons[:3]),
        )  # fmt: skip
        keep = sorted(set(range(len(dataset))) - set(skipped.indices))
        if not keep:
            raise ValueError(f"{name}: every row has an unreadable image, nothing left to train on. First: {skipped.reasons[0]}")
        dataset = dataset.select(keep)
    return dataset, skipped


def prepare_row(row: dict[str, Any], min_pixels: int | None = None, max_pixels: int | None = None) -> dict[str, Any]:
    """A copy of a dataset row ready for TRL: images loaded, normalised and fitted; string prompts with images chat."""
    row = dict(row)
    for column in IMAGE_COLUMNS:
        if column in row and row[column] is not None:
            images = prepare_images(row[column], min_pixels=min_pixels, max_pixels=max_pixels)
            row[column] = images if column == "images" else images[0]
    if isinstance(row.get("prompt"), str) and any(column in row for column in IMAGE_COLUMNS):
        # TRL only places images into chat prompts; a plain question becomes the user turn. Done for every row of a
        # dataset with an image column (text-only rows too) so a batch never mixes strings and chats.
        row["prompt"] = [{"role": "user", "content": row["prompt"]}]
    return row
