"""A dataset row's media, loaded for a batch: the one call a row makes into `vlm_grpo.media`.

`load_row_media` finds the row's image and video columns, loads its images (upright 8-bit RGB) and fits them to the
pixel budget, and samples and sizes its clips by the video budget. The row itself (its prompt, where the media go in
it, what rewards get back) is `vlm_grpo.data.rows`'s business.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from PIL import Image

from .clips import Clip
from .columns import image_column, row_clips, video_column
from .images import load_rgb_images

if TYPE_CHECKING:
    from .pixel_budget import PixelBudget
    from .video_budget import VideoBudget

__all__ = ["RowMedia", "load_row_media"]


@dataclass(frozen=True)
class RowMedia:
    """A row's media as the model is fed them, and where the row held them.

    Attributes:
        images: the row's images, loaded, normalised and fitted to the pixel budget.
        clips: the row's clips, sampled and sized by the video budget (empty for a dataset without a video column).
        image_column: `image`, `images` or None.
        video_column: `video`, `videos` or None.
        source_sizes: `(width, height)` of each image as the dataset holds it (upright, before any resizing).
        sources: the row's images loaded and normalised but not fitted (the same objects as `images` where the budget
            left them alone): what image tools cut from (`vlm_grpo.tools`).
    """

    images: list[Image.Image]
    clips: list[Clip]
    image_column: str | None
    video_column: str | None
    source_sizes: list[tuple[int, int]]
    sources: list[Image.Image]


def load_row_media(
    row: dict[str, Any],
    budget: PixelBudget | None = None,
    video_budget: VideoBudget | None = None,
    clip_memo: dict[str, Any] | None = None,
) -> RowMedia | None:
    """The media of `row` loaded and fitted (see `RowMedia`), or None for a row without an image or video column.

    `budget` fits the images (None: left at their size); `video_budget` samples and sizes the clips (None: the default
    budget, no resizing). `clip_memo`, a dict the caller keeps for one batch, loads a clip given by path once for all
    the rows that name it: TRL repeats every row for each of its generations.

    >>> media = load_row_media({"prompt": "Which colour?", "image": Image.new("RGB", (4, 2))})
    >>> [image.size for image in media.images], media.image_column, media.source_sizes
    ([(4, 2)], 'image', [(4, 2)])
    """
    column, clip_column = image_column(row), video_column(row)
    if column is None and clip_column is None:
        return None
    clip_values = row_clips(row) if clip_column else []
    value = row.get(column) if column else None
    images = load_rgb_images([value] if column == "image" and value is not None else value)
    fitted = [budget.fit(image) for image in images] if budget is not None else images
    clips = []
    if clip_values:
        if video_budget is None:
            from .video_budget import VideoBudget

            video_budget = VideoBudget()
        for value in clip_values:
            key = os.fspath(value) if isinstance(value, str | os.PathLike) and clip_memo is not None else None
            if key is None:
                clips.append(video_budget.load(value))
                continue
            if key not in clip_memo:
                clip_memo[key] = video_budget.load(value)
            clips.append(clip_memo[key])
    return RowMedia(fitted, clips, column, clip_column, [image.size for image in images], images)
