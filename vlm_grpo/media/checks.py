"""Which rows' media can be read: missing, corrupt or truncated images and clips found before training, one policy.

A bad image or clip drops its row, logged and counted, so a long run never dies on row 93 412; more than
`MAX_BAD_FRACTION` of a dataset bad is refused (the data looks wrong as a whole). The trainer's `check_dataset`
(`vlm_grpo.data.rows`) and dataset loading (`vlm_grpo.data.load`, which names rows by their file lines) both call
`drop_unreadable_rows`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from ..third_party_logs import datasets_bars_off
from .clips import VideoError, is_clip_value, probe_clip
from .columns import column_media, row_clips
from .images import ImageError, load_image

__all__ = ["MAX_BAD_FRACTION", "SkippedRows", "drop_unreadable_rows", "undecoded"]

logger = logging.getLogger(__name__)


@dataclass
class SkippedRows:
    """Rows dropped by `check_dataset`: their indices in the original dataset and why."""

    indices: list[int] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.indices)


#: Rows with missing or unreadable images or clips are skipped up to this fraction of a dataset; beyond it the data
#: looks wrong as a whole (a wrong media root, a broken download), and training on the rest would quietly teach
#: something else.
MAX_BAD_FRACTION = 0.5
_ANIMATED_FORMATS = ("GIF", "PNG", "WEBP")  # the formats whose frames are an animation (APNG is PNG)


def drop_unreadable_rows(
    dataset: Any,
    column: str | None,
    name: str,
    *,
    clip_column: str | None = None,
    decode: bool = True,
    skip_bad_rows: bool = True,
    row_names: Sequence[str] | None = None,
    stop_hint: str = "skip_bad_rows=False",
    image_refusal: Callable[[int, int], str | None] | None = None,
) -> tuple[Any, SkippedRows]:
    """`(dataset, skipped)`: the rows whose images in `column` or clips in `clip_column` are missing or cannot be
    read dropped, logged and counted. One policy for all: skipped while they are at most `MAX_BAD_FRACTION` of the
    rows, refused beyond.

    Args:
        dataset: a `datasets.Dataset` whose `column` holds one image or a list per row (None: no images), and
            `clip_column` one clip or a list (None: no clips).
        name: the dataset in messages (`train_dataset`, `train.jsonl`).
        decode: decode every image and probe every clip (catches corrupt files); False checks only that files exist.
        skip_bad_rows: False raises at the first bad row instead of skipping it.
        row_names: what messages call each row (e.g. `line 7` of a JSON Lines file); default `row <index>`.
        stop_hint: how the user turns skipping off, named in the skip message (`--no_skip_bad_rows` from the CLI).
        image_refusal: why the model's processor would refuse a decoded image of a size, or None
            (`PixelBudget.refusal`); asked only with `decode`, so such a row is skipped like an unreadable one.

    Raises:
        ImageError / VideoError: a bad row with `skip_bad_rows=False`; more than `MAX_BAD_FRACTION` of the rows bad.
    """
    skipped = SkippedRows()
    raw = undecoded(undecoded(dataset, column), clip_column)
    animated: list[str] = []  # where an animated image is, and its frames: the model is shown its first frame only
    frame_counts: list[int] = []
    image_problem = partial(_image_problem, refusal=image_refusal, frame_counts=frame_counts)
    for index, row in enumerate(raw.select_columns([c for c in (column, clip_column) if c])):
        where = row_names[index] if row_names is not None else f"row {index}"
        # By the column's own name: a row of `file` or `photo` holds its images there, not under `image`.
        media = [("image", m, image_problem, ImageError) for m in (column_media(row, column) if column else [])]
        media += [("clip", m, _clip_problem, VideoError) for m in (row_clips(row) if clip_column else [])]
        positions = {"image": 0, "clip": 0}
        for kind, value, problem_of, error_type in media:
            position = positions[kind]
            positions[kind] += 1
            if value is None:
                plural = "images" if kind == "image" else "videos"
                raise ValueError(f"{name} {where}: {kind} {position} is None; drop it from the row's `{plural}` list.")
            seen = len(frame_counts)
            problem = problem_of(value, decode)
            if len(frame_counts) > seen:
                animated.append(f"{where}, image {position}: {frame_counts[-1]} frames")
            if problem is None:
                continue
            if not skip_bad_rows:
                raise error_type(f"{name} {where}, {kind} {position}: {problem}")
            skipped.indices.append(index)
            skipped.reasons.append(f"{where}, {kind} {position}: {problem}")
            break
    if animated:
        logger.warning("%s: %d animated image(s) (GIF, WebP, APNG; %s): the model is shown each one's first frame; "
                       "to show every frame, give them as clips (a `video` column).", name, len(animated),
                       "; ".join(animated[:3]))  # fmt: skip
    if not skipped:
        return dataset, skipped
    total = len(dataset)
    kinds = "images or clips" if clip_column else "images"
    if len(skipped) > MAX_BAD_FRACTION * total:
        error_type = VideoError if column is None else ImageError
        raise error_type(
            f"{name}: {len(skipped)} of {total} rows have missing or unreadable {kinds}, more than "
            f"{MAX_BAD_FRACTION:.0%}, so the data looks wrong as a whole (check the paths and files); nothing "
            f"is trained on. First: {skipped.reasons[0]}"
        )
    logger.warning(
        "%s: skipped %d of %d rows with missing or unreadable %s (%s to stop instead; more than %.0f%% bad is "
        "refused). %s",
        name, len(skipped), total, kinds, stop_hint, 100 * MAX_BAD_FRACTION, "; ".join(skipped.reasons[:3]),
    )  # fmt: skip
    return dataset.select(sorted(set(range(total)) - set(skipped.indices))), skipped


def undecoded(dataset: Any, column: str | None) -> Any:
    """`dataset` with `column`'s `datasets.Image` / `datasets.Video` feature cast to `decode=False` (`{"bytes",
    "path"}`), so a corrupt or missing file is our error to report, not a crash inside datasets."""
    if column is None:
        return dataset
    import datasets
    from datasets import Sequence

    kinds = tuple(k for k in (getattr(datasets, "Image", None), getattr(datasets, "Video", None)) if k is not None)
    lists = tuple(k for k in (Sequence, getattr(datasets, "List", None)) if k is not None)
    feature = dataset.features.get(column)
    if isinstance(feature, kinds):
        undecoded_feature = type(feature)(decode=False)
    elif isinstance(feature, lists) and isinstance(feature.feature, kinds):
        undecoded_feature = type(feature)(type(feature.feature)(decode=False))
    elif isinstance(feature, list) and feature and isinstance(feature[0], kinds):
        undecoded_feature = [type(feature[0])(decode=False)]
    else:
        return dataset
    with datasets_bars_off():  # a type change: no "Casting the dataset" bar
        return dataset.cast_column(column, undecoded_feature)


def _image_problem(image: Any, decode: bool, refusal: Callable[[int, int], str | None] | None = None,
                   frame_counts: list[int] | None = None) -> str | None:  # fmt: skip
    """Why `image` cannot be used, or None: unreadable, or of a size `refusal` names. Without `decode`, only an image
    stored as a file path is checked, for the file's existence (a cheap `stat`, done even when decoding every image is
    switched off). An image of several frames (an animated GIF) appends their number to `frame_counts`."""
    if not decode and _exists_or_not_a_path(image, os.path.isfile):
        return None
    try:
        loaded = load_image(image)
    except ImageError as error:
        return str(error)
    # Not a phone's MPO JPEG (a preview or depth frame beside the photo) or a multi-page TIFF: frames of one moment.
    if frame_counts is not None and loaded.format in _ANIMATED_FORMATS and getattr(loaded, "n_frames", 1) > 1:
        frame_counts.append(loaded.n_frames)
    return refusal(*loaded.size) if refusal is not None else None


def _clip_problem(clip: Any, decode: bool) -> str | None:
    """Why `clip` cannot be used, or None. Without `decode`, a clip given as a path is only checked to exist."""
    if not is_clip_value(clip):
        return f"{type(clip).__name__!r} is not a clip (a list of frames, a folder, a video file)"
    if not decode and _exists_or_not_a_path(clip, os.path.exists):
        return None
    try:
        probe_clip(clip)
    except VideoError as error:
        return str(error)
    return None


def _exists_or_not_a_path(value: Any, exists: Callable[[Any], bool]) -> bool:
    """Whether `value` (a path, or datasets' undecoded `{"bytes", "path"}`) is a file that exists, or no path at all
    (bytes, arrays, PIL images: nothing to `stat`)."""
    path = value.get("path") if isinstance(value, dict) and value.get("bytes") is None else value
    return not isinstance(path, (str, os.PathLike)) or exists(path)
