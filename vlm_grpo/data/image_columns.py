"""Which column of your data holds its images, found by what the column holds when it is not named.

`--image_column` names it; else `image` or `images` is it; else the one column whose values are images
(`vlm_grpo.media.columns.holds_images`: paths or URLs of image files, encoded image bytes, PIL images, `{"bytes",
"path"}` dicts, one per row or a list), whatever it is called: `file`, `path`, `src`. Two such columns are refused
naming `--image_column`, and so is a column named like images (`photo`, `img_path`) whose values are none: the run
never trains on text alone because a column had an unexpected name. Beside a clip column nothing is guessed (a list
of frame paths is a clip there).
"""

from __future__ import annotations

import logging
from typing import Any

from ..media.columns import IMAGE_COLUMNS, IMAGE_LIKE_NAMES, VIDEO_COLUMNS, holds_images

__all__ = ["SAMPLE_ROWS", "find_image_column"]

#: Rows a column's values are read from to tell whether it holds images: enough to see through a few empty cells,
#: few enough to be instant on any dataset.
SAMPLE_ROWS = 32
_log = logging.getLogger(__name__)


def _is_image_feature(feature: Any) -> bool:
    from datasets import Image

    inner = getattr(feature, "feature", None) or (feature[0] if isinstance(feature, list) and feature else None)
    return isinstance(feature, Image) or isinstance(inner, Image)


def find_image_column(dataset: Any, given: str | None, video_column: str | None) -> str | None:
    """The column holding `dataset`'s images: `given`, else `image` / `images`, else the one column whose values are
    images (None: no column holds any). Data with clips (`video`, `videos`, `video_column`) is not looked through: a
    list of frame paths there is a clip, and its images (if any) are named.

    Raises:
        ValueError: two or more columns hold images, or a column named like images (`photo`) holds none; the
            message names `--image_column` (the loader raises it as its `DatasetError`).
    """
    columns = list(dataset.column_names)
    if given is not None or any(c in columns for c in IMAGE_COLUMNS):
        chosen = given if given is not None else next(c for c in IMAGE_COLUMNS if c in columns)
        _say_unshown_images(dataset, chosen, video_column)
        return chosen
    if video_column in columns or any(c in columns for c in VIDEO_COLUMNS):
        # Beside clips, a column of image paths may be a clip's frames: images there are named, not guessed.
        return None
    candidates = list(columns)
    sample = dataset.select(range(min(len(dataset), SAMPLE_ROWS))) if candidates else None
    found = [c for c in candidates if _is_image_feature(dataset.features[c]) or holds_images(sample[c])]
    if len(found) > 1:
        shown = ", ".join(f"`{c}`" for c in found)
        raise ValueError(f"columns {shown} all hold images; name the one to train on with --image_column "
                           f"{found[0]}.")  # fmt: skip
    if found:
        return found[0]
    named = [c for c in candidates if c.lower() in IMAGE_LIKE_NAMES]
    if named:
        example = next((v for v in sample[named[0]] if v is not None), None)
        raise ValueError(f"column `{named[0]}` is named like an image column but holds no image paths, URLs or bytes "
                           f"(e.g. {str(example)[:60]!r}); if it holds images, name it with --image_column "
                           f"{named[0]}.")  # fmt: skip
    return None


def _say_unshown_images(dataset: Any, chosen: str, video_column: str | None) -> None:
    """One warning naming the other columns that hold images: the model sees only `chosen`'s (the others reach the
    rewards as columns), which a dataset with `image` and `image_2` would otherwise not learn until its results."""
    # `image` beside `images` is refused where rows are made; `--image_column photo` beside `image` is said here.
    skip = (chosen, video_column, *VIDEO_COLUMNS, *(IMAGE_COLUMNS if chosen in IMAGE_COLUMNS else ()))
    features = dataset.features
    others = [c for c in dataset.column_names if c not in skip and _may_hold_images(features[c])]
    if not others or len(dataset) == 0:
        return
    sample = dataset.select(range(min(len(dataset), SAMPLE_ROWS))).select_columns(others)  # no other column decoded
    unshown = [c for c in others if _is_image_feature(features[c]) or holds_images(sample[c])]
    if unshown:
        shown = ", ".join(f"`{c}`" for c in unshown)
        _log.warning(f"column(s) {shown} also hold images; the model is shown only `{chosen}`'s (the others reach the "
                     f"rewards as columns). To show several images a prompt, give them as one list in an `images` "
                     f"column.")  # fmt: skip


def _may_hold_images(feature: Any) -> bool:
    """Whether a column of `feature` can hold images: an `Image` feature, or strings / bytes (paths, URLs, encoded
    files), one or a list a row; not audio, video or numbers, which are not decoded to find out."""
    from datasets import List, Sequence, Value

    inner = feature.feature if isinstance(feature, (List, Sequence)) else feature
    return _is_image_feature(feature) or (
        isinstance(inner, Value) and inner.dtype in ("string", "large_string", "binary", "large_binary")
    )
