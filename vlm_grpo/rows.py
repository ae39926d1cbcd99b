"""Dataset rows -> what TRL's GRPO loop expects, with bad input caught before training starts.

`check_dataset` runs once, at trainer construction: structural problems (no rows, no image column
for prompts that have image placeholders, images under another column name, a placeholder count
that differs from the row's images, both `image` and `images` columns) raise a `ValueError` naming
the row and the fix; missing, unreadable or truncated images drop their row, logged and counted, so a long
run never dies on row 93 412 (`drop_unreadable_rows`: one policy for every bad image, refused beyond half the rows).

`prepare_row` runs per batch: images normalised (RGB, EXIF, alpha on white, 16-bit...), fitted to
the pixel budget (`vlm_grpo.pixel_budget`) and always given as an `images` list; a plain-string
prompt becomes a user message with the images at its `<image>` placeholders. `rows_for_rewards`
undoes the last two for the reward functions, so they receive the dataset's own format.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from PIL import Image

from .images import ImageError, load_image, load_rgb_images
from .prompts import IMAGE_COLUMNS, IMAGE_PLACEHOLDER, image_column, user_content

if TYPE_CHECKING:
    from .pixel_budget import PixelBudget

__all__ = [
    "IMAGE_PLACEHOLDER",
    "MAX_BAD_FRACTION",
    "SkippedRows",
    "check_dataset",
    "count_image_placeholders",
    "dataset_row",
    "drop_unreadable_rows",
    "prepare_row",
    "row_images",
    "rows_for_rewards",
    "source_image_sizes",
]

logger = logging.getLogger(__name__)

# Column names that mean images, for the "rename it" error (columns holding images are found by their values too).
_IMAGE_LIKE_NAMES = (
    "img", "imgs", "picture", "pictures", "photo", "photos", "pixel_values", "image_path", "image_paths", "image_file",
    "image_files", "image_bytes",
)  # fmt: skip
# prepare_row keeps the row's own prompt and image column name here, for `rows_for_rewards`.
_SOURCE = "_vlm_grpo_source"


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
# (`<image>` is not one: it is the dataset's own placeholder, see IMAGE_PLACEHOLDER.)
_TEMPLATE_MARKERS = ("<|im_start|>", "<start_of_turn>", "<|start_header_id|>", "<|image_pad|>", "[INST]")


def _check_prompt(prompt: Any, n_images: int, index: int, name: str) -> None:
    if isinstance(prompt, str):
        if n_images and any(marker in prompt for marker in _TEMPLATE_MARKERS):
            raise ValueError(
                f"{name} row {index}: the prompt is a string with a chat template already applied, and the row has "
                f"{n_images} image(s). Images need chat-message prompts: pass the raw messages, e.g. "
                "[{'role': 'user', 'content': 'What colour is the shape?'}], and let the trainer apply the template."
            )
        placeholders = prompt.count(IMAGE_PLACEHOLDER)
        if placeholders and placeholders != n_images:
            raise ValueError(
                f"{name} row {index}: the prompt has {placeholders} {IMAGE_PLACEHOLDER} placeholder(s) but the row has "
                f"{n_images} image(s). Make them match, or drop the placeholders to put the images before the text."
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


def _string_placeholders(prompt: Any) -> int:
    return prompt.count(IMAGE_PLACEHOLDER) if isinstance(prompt, str) else 0


def _holds_images(value: Any) -> bool:
    """Whether a cell holds an image, or a list starting with one (PIL, or a datasets `{"bytes", "path"}` dict)."""
    if isinstance(value, (list, tuple)) and value:
        value = value[0]
    return isinstance(value, Image.Image) or isinstance(value, dict) and {"bytes", "path"} <= set(value)


def _is_image_feature(feature: Any) -> bool:
    from datasets import Image as ImageFeature

    inner = getattr(feature, "feature", None) or (feature[0] if isinstance(feature, list) and feature else None)
    return isinstance(feature, ImageFeature) or isinstance(inner, ImageFeature)


def _refuse_misnamed_image_column(dataset: Any, columns: list[str], name: str) -> None:
    """Raise when images sit under another column name: the trainer would silently train text-only."""
    features = getattr(dataset, "features", None) or {}
    first = dataset[0] if hasattr(dataset, "__len__") and len(dataset) and hasattr(dataset, "__getitem__") else {}
    for column in columns:
        if column == "prompt":
            continue
        feature, value = features.get(column), first.get(column) if isinstance(first, dict) else None
        if column.lower() in _IMAGE_LIKE_NAMES or _is_image_feature(feature) or _holds_images(value):
            list_of_images = isinstance(value, (list, tuple)) and _holds_images(value)
            list_feature = _is_image_feature(feature) and (isinstance(feature, list) or hasattr(feature, "feature"))
            target = "images" if list_of_images or list_feature else "image"
            raise ValueError(
                f"{name} has no `image` or `images` column, but column `{column}` looks like it holds images, so the "
                f"model would train without them. Rename it: `dataset = dataset.rename_column({column!r}, {target!r})` "
                "(`image` for one image per row, `images` for a list)."
            )


def check_dataset(
    dataset: Any, name: str = "train_dataset", *, check_images: bool = True, skip_bad_rows: bool = True
) -> tuple[Any, SkippedRows]:
    """Validate a dataset before training; return `(dataset, skipped)` with unreadable-image rows removed.

    Args:
        dataset: a `datasets.Dataset` (checked row by row) or an `IterableDataset` (only its columns are checked:
            it cannot be scanned without consuming it).
        name: used in messages (`train_dataset`, `eval_dataset`).
        check_images: decode every image once (catches truncated/corrupt files up front); False checks only that
            image files exist.
        skip_bad_rows: drop rows whose images are missing or cannot be read (logged, counted in `skipped`; more than
            `MAX_BAD_FRACTION` of the rows is refused); False raises at the first instead.
    """
    if dataset is None:
        return dataset, SkippedRows()
    columns = list(getattr(dataset, "column_names", None) or [])
    if columns and "prompt" not in columns:
        raise ValueError(
            f"{name} has no `prompt` column (columns: {columns}). Rename your question column to `prompt`."
        )
    if "image" in columns and "images" in columns:
        raise ValueError(f"{name} has both `image` and `images` columns; keep one (`images` for several per row).")
    column = image_column(columns)
    if column is None:
        _refuse_misnamed_image_column(dataset, columns, name)
    if not hasattr(dataset, "__len__"):
        return dataset, SkippedRows()
    if len(dataset) == 0:
        raise ValueError(f"{name} is empty: GRPO needs at least one prompt.")

    # Placeholders against image counts, with the images undecoded: counting them needs no pixels.
    raw = dataset if column is None else _undecoded(dataset, column)
    for index, row in enumerate(raw.select_columns(["prompt"] + ([column] if column else []))):
        if column is None and (count_image_placeholders(row["prompt"]) or _string_placeholders(row["prompt"])):
            raise ValueError(
                f"{name} row {index}: the prompt has image placeholders but the dataset has no `image` or `images` "
                f"column (columns: {columns}). Add the images as an `image` (one) or `images` (list) column."
            )
        _check_prompt(row["prompt"], len(row_images(row)), index, name)
    if column is None:
        return dataset, SkippedRows()
    return drop_unreadable_rows(dataset, column, name, decode=check_images, skip_bad_rows=skip_bad_rows)


#: Rows with missing or unreadable images are skipped up to this fraction of a dataset; beyond it the data looks wrong
#: as a whole (a wrong image root, a broken download), and training on the rest would quietly teach something else.
MAX_BAD_FRACTION = 0.5


def drop_unreadable_rows(
    dataset: Any,
    column: str,
    name: str,
    *,
    decode: bool = True,
    skip_bad_rows: bool = True,
    row_names: Sequence[str] | None = None,
    stop_hint: str = "skip_bad_rows=False",
) -> tuple[Any, SkippedRows]:
    """`(dataset, skipped)`: the rows whose images in `column` are missing or cannot be decoded dropped, logged and
    counted. One policy for both: skipped while they are at most `MAX_BAD_FRACTION` of the rows, refused beyond.

    Args:
        dataset: a `datasets.Dataset` whose `column` holds one image or a list per row.
        name: the dataset in messages (`train_dataset`, `train.jsonl`).
        decode: decode every image (catches corrupt files); False checks only that image files exist.
        skip_bad_rows: False raises at the first bad row instead of skipping it.
        row_names: what messages call each row (e.g. `line 7` of a JSON Lines file); default `row <index>`.
        stop_hint: how the user turns skipping off, named in the skip message (`--no_skip_bad_rows` from the CLI).

    Raises:
        ImageError: a bad row with `skip_bad_rows=False`; more than `MAX_BAD_FRACTION` of the rows bad.
    """
    skipped = SkippedRows()
    for index, row in enumerate(_undecoded(dataset, column).select_columns([column])):
        where = row_names[index] if row_names is not None else f"row {index}"
        for position, image in enumerate(row_images(row)):
            if image is None:
                raise ValueError(f"{name} {where}: image {position} is None; drop it from the row's `images` list.")
            problem = _image_problem(image, decode)
            if problem is None:
                continue
            if not skip_bad_rows:
                raise ImageError(f"{name} {where}, image {position}: {problem}")
            skipped.indices.append(index)
            skipped.reasons.append(f"{where}, image {position}: {problem}")
            break
    if not skipped:
        return dataset, skipped
    total = len(dataset)
    if len(skipped) > MAX_BAD_FRACTION * total:
        raise ImageError(
            f"{name}: {len(skipped)} of {total} rows have missing or unreadable images, more than "
            f"{MAX_BAD_FRACTION:.0%}, so the data looks wrong as a whole (check the image paths and files); nothing "
            f"is trained on. First: {skipped.reasons[0]}"
        )
    logger.warning(
        "%s: skipped %d of %d rows with missing or unreadable images (%s to stop instead; more than %.0f%% bad is "
        "refused). %s",
        name, len(skipped), total, stop_hint, 100 * MAX_BAD_FRACTION, "; ".join(skipped.reasons[:3]),
    )  # fmt: skip
    return dataset.select(sorted(set(range(total)) - set(skipped.indices))), skipped


def _undecoded(dataset: Any, column: str) -> Any:
    """`dataset` with `column` read as undecoded images (`{"bytes", "path"}`), so a corrupt or missing file is our
    error to report, not a crash inside datasets."""
    from datasets import Image as ImageFeature
    from datasets import List
    from datasets import Sequence as SequenceFeature

    feature = dataset.features.get(column)
    if isinstance(feature, ImageFeature):
        return dataset.cast_column(column, ImageFeature(decode=False))
    if isinstance(feature, (List, SequenceFeature)) and isinstance(feature.feature, ImageFeature):
        return dataset.cast_column(column, List(ImageFeature(decode=False)))
    if isinstance(feature, list) and feature and isinstance(feature[0], ImageFeature):
        return dataset.cast_column(column, [ImageFeature(decode=False)])
    return dataset


def _image_problem(image: Any, decode: bool) -> str | None:
    """Why `image` cannot be used, or None. Without `decode`, only an image stored as a file path is checked, for the
    file's existence (a cheap `stat`, done even when decoding every image is switched off)."""
    if not decode:
        path = image.get("path") if isinstance(image, dict) and image.get("bytes") is None else image
        if not isinstance(path, (str, os.PathLike)) or os.path.isfile(path):
            return None
    try:
        load_image(image)
    except ImageError as error:
        return str(error)
    return None


def prepare_row(row: dict[str, Any], budget: PixelBudget | None = None) -> dict[str, Any]:
    """A copy of a dataset row ready for TRL's multimodal path.

    Rows of a dataset with an `image` or `images` column get their images loaded, normalised, fitted with `budget`
    (`PixelBudget.fit`; None leaves their size alone) and put under `images` as a list (`[]` for a text-only row: TRL
    turns a missing single image into None, which breaks the processor). A string prompt becomes a user message (TRL
    places images only in chat prompts) with the images at its `<image>` placeholders, or before the text when it has
    none. The row's own prompt, image column and image sizes are kept for `rows_for_rewards` and
    `source_image_sizes`. Rows without an image column are returned unchanged.
    """
    column = image_column(row)
    if column is None:
        return dict(row)
    value = row[column]
    if column == "image":
        value = None if value is None else [value]
    images = load_rgb_images(value)
    row = {k: v for k, v in row.items() if k not in IMAGE_COLUMNS}
    row["images"] = [budget.fit(image) for image in images] if budget is not None else images
    row[_SOURCE] = {"prompt": row.get("prompt"), "image_column": column, "image_sizes": [im.size for im in images]}
    if isinstance(row.get("prompt"), str):
        # Done for every row of a dataset with an image column (text-only rows too) so a batch never mixes strings
        # and chats.
        row["prompt"] = [{"role": "user", "content": user_content(row["prompt"])}]
    return row


def source_image_sizes(row: dict[str, Any]) -> list[tuple[int, int]] | None:
    """`(width, height)` of each image of a `prepare_row` result as the dataset holds it (upright, before any
    resizing), recorded when the row was prepared; None for a row `prepare_row` did not prepare."""
    source = row.get(_SOURCE)
    return None if source is None else source["image_sizes"]


def rows_for_rewards(
    inputs: list[dict[str, Any]],
    prompts: list[Any],
    completions: list[Any],
    completion_ids: list[list[int]],
    decode: Callable[[list[list[int]]], list[str]],
) -> tuple[list[dict[str, Any]], list[Any], list[Any]]:
    """`(inputs, prompts, completions)` as the reward functions would get them from the dataset as it was given.

    Undoes `prepare_row` for rewards: a row whose prompt was a string gets it back, and its completion as the
    decoded string (TRL's standard format, not `[{"role": "assistant", ...}]`); a row with an `image` column gets
    its `image` back instead of the `images` list. `decode` is the processor's `batch_decode` of token ids, as TRL
    decodes standard-format completions.
    """
    was_string = [isinstance(row.get(_SOURCE, {}).get("prompt"), str) for row in inputs]
    texts = iter(decode([ids for ids, s in zip(completion_ids, was_string) if s]) if any(was_string) else [])
    prompts = [row[_SOURCE]["prompt"] if s else p for row, p, s in zip(inputs, prompts, was_string)]
    completions = [next(texts) if s else c for c, s in zip(completions, was_string)]
    return [dataset_row(row) for row in inputs], prompts, completions


def dataset_row(row: dict[str, Any]) -> dict[str, Any]:
    """A `prepare_row` result with the dataset's own prompt and image column back (and nothing internal)."""
    source = row.get(_SOURCE)
    if source is None:
        return row
    row = {k: v for k, v in row.items() if k != _SOURCE}
    row["prompt"] = source["prompt"]
    if source["image_column"] == "image":
        images = row.pop("images")
        row["image"] = images[0] if images else None
    return row
