"""Dataset rows -> what TRL's GRPO loop expects, with bad input caught before training starts.

`check_dataset` runs once, at trainer construction: structural problems (no rows, no image / video
column for prompts that have image / video placeholders, images under another column name, a
placeholder count that differs from the row's images or clips, both `image` and `images` columns)
raise a `ValueError` naming the row and the fix; missing, unreadable or truncated images, and clips that
cannot be read (a missing or corrupt file, no frames, frames of different sizes), drop their row,
logged and counted, so a long run never dies on row 93 412 (`drop_unreadable_rows`: one policy for
every bad image or clip, refused beyond half the rows).

`prepare_row` runs per batch: images normalised (RGB, EXIF, alpha on white, 16-bit...), fitted to
the pixel budget (`vlm_grpo.media.pixel_budget`) and always given as an `images` list; a plain-string
prompt becomes a user message with the images at its `<image>` placeholders. Rows of a dataset with
a `video` / `videos` column get their clips sampled and sized by the video budget
(`vlm_grpo.media.video_budget`) and every image and clip placed in the prompt's content blocks (TRL has
no video path: the trainer processes these rows itself). `rows_for_rewards` undoes this for the
reward functions, so they receive the dataset's own format.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from PIL import Image

from ..media.checks import MAX_BAD_FRACTION, SkippedRows, drop_unreadable_rows, undecoded
from ..media.columns import (
    IMAGE_COLUMNS,
    IMAGE_LIKE_NAMES,
    VIDEO_COLUMNS,
    holds_images,
    image_column,
    is_chat,
    row_clips,
    row_images,
    video_column,
)
from ..media.pixel_budget import fed_size
from ..media.row_media import load_row_media
from ..rewards.checks import ROW_ORIGIN, RewardFunctionError
from .prompts import (
    IMAGE_PLACEHOLDER,
    VIDEO_PLACEHOLDER,
    count_blocks,
    count_placeholders,
    place_media,
    place_placeholders,
    user_content,
)

if TYPE_CHECKING:
    from ..media.pixel_budget import PixelBudget
    from ..media.video_budget import VideoBudget

__all__ = [
    "IMAGE_PLACEHOLDER",
    "MAX_BAD_FRACTION",
    "SkippedRows",
    "add_image_sizes",
    "check_dataset",
    "count_image_placeholders",
    "dataset_row",
    "drop_unreadable_rows",
    "name_failing_row",
    "prepare_row",
    "row_clips",
    "row_images",
    "rows_for_rewards",
    "source_image_sizes",
    "source_images",
]

logger = logging.getLogger(__name__)

_VIDEO_LIKE_NAMES = ("clip", "clips", "frames", "video_path", "video_paths", "video_file", "video_files", "movie")
# prepare_row keeps the row's own prompt and image column name here, for `rows_for_rewards`.
_SOURCE = "_vlm_grpo_source"


def count_image_placeholders(prompt: Any) -> int:
    """Number of `{"type": "image"}` content blocks in a chat prompt (0 for plain strings)."""
    return count_blocks(prompt, "image") if is_chat(prompt) else 0


# Markers that show a chat template was already applied to a string prompt; images cannot be placed then.
# (`<image>` is not one: it is the dataset's own placeholder, see IMAGE_PLACEHOLDER.)
_TEMPLATE_MARKERS = ("<|im_start|>", "<start_of_turn>", "<|start_header_id|>", "<|image_pad|>", "[INST]")


def _check_prompt(prompt: Any, n_images: int, index: int, name: str, n_videos: int = 0) -> None:
    if isinstance(prompt, str):
        if (n_images or n_videos) and any(marker in prompt for marker in _TEMPLATE_MARKERS):
            raise ValueError(
                f"{name} row {index}: the prompt is a string with a chat template already applied, and the row has "
                f"{n_images} image(s) and {n_videos} clip(s). Images and clips need chat-message prompts: pass the "
                "raw messages, e.g. [{'role': 'user', 'content': 'What colour is the shape?'}], and let the trainer "
                "apply the template."
            )
        for placeholder, count, kind in zip((IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER), (n_images, n_videos),
                                            ("image(s)", "clip(s)")):  # fmt: skip
            placeholders = prompt.count(placeholder)
            if placeholders and placeholders != count:
                raise ValueError(
                    f"{name} row {index}: the prompt has {placeholders} {placeholder} placeholder(s) but the row has "
                    f"{count} {kind}. Make them match, or drop the placeholders to put them before the text."
                )
        return
    if not is_chat(prompt):
        raise ValueError(
            f"{name} row {index}: `prompt` must be a string or a list of chat messages "
            f"({{'role': ..., 'content': ...}}), got {type(prompt).__name__}."
        )
    # `<image>` written in a message's text places an image there, as in a string prompt (`place_placeholders`);
    # other string contents get the images put before the first user text (TRL); structured contents place each.
    prompt = place_placeholders(prompt)
    structured = any(isinstance(message.get("content"), list) for message in prompt)
    for kind, count, noun in (("image", n_images, "image(s)"), ("video", n_videos, "clip(s)")):
        placeholders = count_blocks(prompt, kind)
        if (structured or placeholders) and placeholders != count:
            raise ValueError(
                f"{name} row {index}: the prompt has {placeholders} {kind} placeholder(s) ({{'type': '{kind}'}}) but "
                f"the row has {count} {noun}. Make them match, or give the messages plain-string contents and they "
                "are put before the first user message."
            )


def _placeholders(prompt: Any, kind: str) -> int:
    """`kind` ("image" / "video") placeholders of a prompt: `<image>` / `<video>` in a string, blocks in messages."""
    if isinstance(prompt, str):
        return count_placeholders(prompt)[kind == "video"]
    return count_blocks(place_placeholders(prompt), kind) if is_chat(prompt) else 0


def _is_image_feature(feature: Any) -> bool:
    from datasets import Image as ImageFeature

    inner = getattr(feature, "feature", None) or (feature[0] if isinstance(feature, list) and feature else None)
    return isinstance(feature, ImageFeature) or isinstance(inner, ImageFeature)


def _refuse_misnamed_video_column(columns: list[str], name: str) -> None:
    """Raise when clips seem to sit under another column name: the trainer would silently train without them."""
    for column in columns:
        if column.lower() in _VIDEO_LIKE_NAMES:
            raise ValueError(
                f"{name} has no `video` or `videos` column, but column `{column}` looks like it holds clips, so the "
                f"model would train without them. Rename it: `dataset = dataset.rename_column({column!r}, 'video')` "
                "(`video` for one clip per row, `videos` for a list)."
            )


def _refuse_misnamed_image_column(dataset: Any, columns: list[str], name: str) -> None:
    """Raise when images sit under another column name: the trainer would silently train text-only."""
    features = getattr(dataset, "features", None) or {}
    first = dataset[0] if hasattr(dataset, "__len__") and len(dataset) and hasattr(dataset, "__getitem__") else {}
    for column in columns:
        if column == "prompt" or column in VIDEO_COLUMNS:  # a clip's frames are images too
            continue
        feature, value = features.get(column), first.get(column) if isinstance(first, dict) else None
        # By name, by feature, or by what the first row holds (image paths, bytes, PIL images...): a column called
        # `file` holding `img/0.jpg` is found as surely as one called `photo`.
        if column.lower() in IMAGE_LIKE_NAMES or _is_image_feature(feature) or holds_images([value]):
            list_of_images = isinstance(value, (list, tuple)) and holds_images([value])
            list_feature = _is_image_feature(feature) and (isinstance(feature, list) or hasattr(feature, "feature"))
            target = "images" if list_of_images or list_feature else "image"
            raise ValueError(
                f"{name} has no `image` or `images` column, but column `{column}` looks like it holds images, so the "
                f"model would train without them. Rename it: `dataset = dataset.rename_column({column!r}, {target!r})` "
                "(`image` for one image per row, `images` for a list)."
            )


def check_dataset(
    dataset: Any,
    name: str = "train_dataset",
    *,
    check_images: bool = True,
    skip_bad_rows: bool = True,
    pixel_budget: PixelBudget | None = None,
) -> tuple[Any, SkippedRows]:
    """Validate a dataset before training; return `(dataset, skipped)` with unreadable-image / clip rows removed.

    Args:
        dataset: a `datasets.Dataset` (checked row by row) or an `IterableDataset` (only its columns are checked:
            it cannot be scanned without consuming it).
        name: used in messages (`train_dataset`, `eval_dataset`).
        check_images: decode every image once and open every clip (`vlm_grpo.media.clips.probe_clip`: a file's stream is
            read, not decoded; frames' headers are read), so truncated or corrupt files surface up front; False
            checks only that image and clip files exist.
        skip_bad_rows: drop rows whose images or clips are missing or cannot be read (logged, counted in `skipped`;
            more than `MAX_BAD_FRACTION` of the rows is refused); False raises at the first instead.
        pixel_budget: the budget images are fed with; with `check_images`, an image its processor would refuse (a
            Qwen-VL image over 200:1) counts as unreadable, found here rather than at the batch that holds it.
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
    clip_column = video_column(columns)
    if clip_column is None:
        _refuse_misnamed_video_column(columns, name)
    if not hasattr(dataset, "__len__"):
        return dataset, SkippedRows()
    if len(dataset) == 0:
        raise ValueError(f"{name} is empty: GRPO needs at least one prompt.")

    # Placeholders against image and clip counts, with the media undecoded: counting them needs no pixels.
    raw = undecoded(undecoded(dataset, column), clip_column)
    read_columns = ["prompt"] + [c for c in (column, clip_column) if c]
    for index, row in enumerate(raw.select_columns(read_columns)):
        images, clips = row_images(row) if column else [], row_clips(row) if clip_column else []
        for kind, present, names in (("image", column, IMAGE_COLUMNS), ("video", clip_column, VIDEO_COLUMNS)):
            if present is None and _placeholders(row["prompt"], kind):
                raise ValueError(
                    f"{name} row {index}: the prompt has {kind} placeholders but the dataset has no `{names[0]}` or "
                    f"`{names[1]}` column (columns: {columns}). Add them as a `{names[0]}` (one) or `{names[1]}` "
                    "(list) column."
                )
        _check_prompt(row["prompt"], len(images), index, name, len(clips))
    if column is None and clip_column is None:
        return dataset, SkippedRows()
    refusal = pixel_budget.refusal if pixel_budget is not None else None
    return drop_unreadable_rows(dataset, column, name, clip_column=clip_column, decode=check_images,
                                skip_bad_rows=skip_bad_rows, image_refusal=refusal)  # fmt: skip


def prepare_row(
    row: dict[str, Any],
    budget: PixelBudget | None = None,
    video_budget: VideoBudget | None = None,
    clip_memo: dict[str, Any] | None = None,
    *,
    keep_sources: bool = False,
) -> dict[str, Any]:
    """A copy of a dataset row ready for TRL's multimodal path (images) or the trainer's own (clips).

    Rows of a dataset with an `image` or `images` column get their images loaded, normalised, fitted with `budget`
    (`PixelBudget.fit`; None leaves their size alone) and put under `images` as a list (`[]` for a text-only row: TRL
    turns a missing single image into None, which breaks the processor). A string prompt becomes a user message (TRL
    places images only in chat prompts) with the images at its `<image>` placeholders, or before the text when it has
    none. Rows of a dataset with a `video` or `videos` column get their clips sampled and sized by `video_budget`
    (`VideoBudget.load`; None: the default budget, no resizing) and every image and clip placed in the prompt's
    content blocks, with no `images` column: TRL would process the images without the clips. The row's own prompt,
    image and video columns and image sizes are kept for `rows_for_rewards` and `source_image_sizes`. Rows without an
    image or video column are returned unchanged. `clip_memo` (a dict the caller keeps for one batch) loads a clip
    given by path once for all the rows that name it: TRL repeats every row for each of its generations.
    `keep_sources` keeps the images as loaded, before fitting, for `source_images` (image tools cut from them).
    """
    media = load_row_media(row, budget, video_budget, clip_memo)
    if media is None:
        return dict(row)
    source = {"prompt": row.get("prompt"), "image_column": media.image_column, "image_sizes": media.source_sizes}
    if keep_sources:
        source["images"] = media.sources
    if media.video_column is not None:
        source.update(video_column=media.video_column, videos=row[media.video_column])
    row = {k: v for k, v in row.items() if k not in IMAGE_COLUMNS + VIDEO_COLUMNS}
    row[_SOURCE] = source
    prompt = row.get("prompt")
    if is_chat(prompt):  # `<image>` / `<video>` in messages' text mark where the media go, as in a string prompt
        prompt = row["prompt"] = place_placeholders(prompt)
    if media.video_column is None:
        row["images"] = media.images
        if isinstance(prompt, str):
            # Done for every row of a dataset with an image column (text-only rows too) so a batch never mixes
            # strings and chats.
            row["prompt"] = [{"role": "user", "content": user_content(prompt)}]
        return row
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    row["prompt"] = place_media(messages, media.images, media.clips)
    return row


def source_images(row: dict[str, Any]) -> list[Image.Image] | None:
    """The images of a `prepare_row(..., keep_sources=True)` result as loaded, before the pixel budget resized them;
    None for a row prepared without them."""
    source = row.get(_SOURCE)
    return None if source is None else source.get("images")


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
    """A `prepare_row` result with the dataset's own prompt, image and video columns back (and nothing internal, the
    row's origin included): images as loaded, clips as the dataset gave them."""
    source = row.get(_SOURCE)
    if source is None:
        return {k: v for k, v in row.items() if k != ROW_ORIGIN} if ROW_ORIGIN in row else row
    row = {k: v for k, v in row.items() if k not in (_SOURCE, ROW_ORIGIN)}
    images = row_images(row)
    row.pop("images", None)
    row["prompt"] = source["prompt"]
    if source["image_column"] == "image":
        row["image"] = images[0] if images else None
    elif source["image_column"] == "images" or "video_column" not in source:
        row["images"] = images
    if "video_column" in source:
        row[source["video_column"]] = source["videos"]
    return row


def name_failing_row(error: RewardFunctionError, inputs: list[dict[str, Any]]) -> RewardFunctionError:
    """`error` with the failing row's origin ("data.jsonl line 7") set from the batch `inputs` it was raised for."""
    if error.row is not None and 0 <= error.row < len(inputs):
        error.origin = inputs[error.row].get(ROW_ORIGIN) or error.origin
    return error


def add_image_sizes(rows: list[dict[str, Any]], processor: Any) -> list[dict[str, Any]]:
    """`rows` (from `prepare_row`) with `source_image_size` and `fed_image_size` added to each: the sizes grounding
    rewards need, as keyword columns (`(width, height)`, or None for a row without exactly one image or a processor
    that does not resize by a pixel budget).

    Qwen2.5-VL writes boxes in absolute pixels of the image *after* its processor resized it (`smart_resize` to a
    multiple of 28 within the pixel budget), while gold boxes are in the dataset image's pixels. Nothing is decoded
    again: the source size is the one `prepare_row` recorded (upright, as annotations see it), the fed size is the
    processor's resize of the image `prepare_row` produced.
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
