"""The video budget: which frames of a clip the model sees (frame sampling) and at what size (the video pixel budget).

Both are decided here, once, for training, evaluation and every input layout:

- **Frames.** A video file keeps `fps` frames per second of its length (Qwen-VL's own default rate, 2), at most
  `max_frames`, spread evenly; `num_frames` asks for exactly that many instead. Frames given as a list, an array or a
  folder are taken as already sampled at `fps` (or at the `fps` given with them) and only thinned when there are more
  than `max_frames`. The count is rounded down to a multiple of the processor's temporal patch (2 frames for Qwen-VL,
  which pairs frames into one temporal step; a single frame is repeated), so no frame is padded in by the processor.
  The processor itself never samples (`do_sample_frames=False`): what the budget picked is what the model sees, with
  each frame's index and the source's rate passed on for Qwen's temporal positions and timestamps.
- **Pixels.** Qwen-VL's video processors resize by a pixel budget of their own, `video_processor.size`
  (`shortest_edge` / `longest_edge`): per frame for Qwen2/2.5-VL, over frames x area of the whole clip for Qwen3-VL
  (`vlm_grpo.families.Family.video_budget`). As with images (`vlm_grpo.media.pixel_budget`), those settings are the budget:
  `VLMGRPOConfig.video_min_pixels` / `video_max_pixels` overwrite them (logged), and frames are resized once, to the
  size the processor's own `smart_resize` gives, so the processor resizes nothing.

Memory grows with frames x pixels x G (every completion of a group repeats its clip on TRL's plain path), so the
defaults are RL-sized: 2 fps, at most 16 frames.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..families import FAMILIES
from ..validation import is_int
from .clips import Clip, load_clip
from .pixel_budget import check_pixel_budget, update_size_budget

__all__ = [
    "DEFAULT_FPS",
    "DEFAULT_MAX_FRAMES",
    "VIDEO_SETTINGS",
    "VideoBudget",
    "apply_video_budget",
    "check_frame_sampling",
    "fed_frame_size",
    "video_budget_for_call",
    "video_processor_of",
]

logger = logging.getLogger(__name__)

DEFAULT_FPS = 2.0
DEFAULT_MAX_FRAMES = 16
# Each video processor's budget rule, by its class name (the torchvision class, or the PIL stand-in's
# `video_processor_type`), from the family records.
_RULES = {f.video_processor: f.video_budget for f in FAMILIES.values() if f.video_processor}
_KEYS = {"video_min_pixels": "shortest_edge", "video_max_pixels": "longest_edge"}
#: The video budget's settings as `VLMGRPOConfig` and `vlm_grpo.evaluate` name them.
VIDEO_SETTINGS = ("video_fps", "video_max_frames", "video_num_frames", "video_min_pixels", "video_max_pixels")
_SAID_SHORT: set[int] = set()  # the `num_frames` settings a clip shorter than them was named for (once a process)


def check_frame_sampling(fps: float | None, max_frames: int | None, num_frames: int | None) -> None:
    """Raise ValueError unless each setting is None or positive (frame counts integers)."""
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, int | float) or not fps > 0):
        raise ValueError(f"video_fps must be a positive number, got {fps!r}.")
    for name, value in (("video_max_frames", max_frames), ("video_num_frames", num_frames)):
        if value is not None and (not is_int(value) or value <= 0):
            raise ValueError(f"{name} must be a positive integer or None, got {value!r}.")


def _rule(video_processor: Any) -> str | None:
    name = getattr(video_processor, "video_processor_type", None) or type(video_processor).__name__
    return _RULES.get(name)


def fed_frame_size(video_processor: Any, num_frames: int, width: int, height: int) -> tuple[int, int] | None:
    """`(width, height)` a Qwen-VL video processor resizes the frames of a `num_frames`-frame clip of `width` x
    `height` to, with its own `smart_resize` and settings; None for a video processor it does not know."""
    rule = _rule(video_processor)
    if rule is None:
        return None
    size = video_processor.size
    min_pixels, max_pixels = int(size["shortest_edge"]), int(size["longest_edge"])
    factor = video_processor.patch_size * video_processor.merge_size
    if rule == "frame":
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        fed_height, fed_width = smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
    else:  # the module imports without torchvision (its torchvision import is guarded)
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

        fed_height, fed_width = smart_resize(
            num_frames, height, width, temporal_factor=video_processor.temporal_patch_size, factor=factor,
            min_pixels=min_pixels, max_pixels=max_pixels,
        )  # fmt: skip
    return int(fed_width), int(fed_height)


@dataclass(frozen=True)
class VideoBudget:
    """Which frames of a clip are kept and the size they are fed at; see the module docstring.

    `video_processor` is the processor's video processor (its `size` is the pixel budget, its `temporal_patch_size`
    the frame multiple); None for a processor without one (a clip is then refused by the trainer before this runs).
    """

    fps: float = DEFAULT_FPS
    max_frames: int = DEFAULT_MAX_FRAMES
    num_frames: int | None = None
    video_processor: Any = None

    def __post_init__(self) -> None:
        check_frame_sampling(self.fps, self.max_frames, self.num_frames)

    @property
    def temporal_patch(self) -> int:
        """Frames per temporal step of the model (2 for Qwen-VL): frame counts are multiples of it."""
        return int(getattr(self.video_processor, "temporal_patch_size", 1) or 1)

    def frame_indices(self, total: int, fps: float | None) -> list[int]:
        """Indices of the frames to keep from a clip of `total` frames at `fps` frames per second (None: frames
        given as already sampled)."""
        if self.num_frames is not None:
            count = self.num_frames
        elif fps:
            count = min(self.max_frames, max(1, math.floor(total / fps * self.fps)))
        else:
            count = min(self.max_frames, total)
        step = self.temporal_patch
        count = max(step, count - count % step)
        if self.num_frames is not None and total < count and self.num_frames not in _SAID_SHORT:
            _SAID_SHORT.add(self.num_frames)  # linspace repeats frames: said once
            logger.warning(f"a clip of {total} frames is shown as {count} (video_num_frames={self.num_frames}): its "
                           f"frames repeat. Lower video_num_frames, or set video_max_frames instead (a cap, not a "
                           f"count).")  # fmt: skip
        return np.linspace(0, total - 1, count).round().astype(int).tolist()

    def fit(self, clip: Clip) -> Clip:
        """`clip` with its frames at the size the model is fed (the processor's own `smart_resize`), and the rate
        it is taken at when its source gave none (`fps`). Never modified in place."""
        if clip.fps is None:
            clip = Clip(clip.frames, self.fps, clip.indices, clip.total_frames)
        if self.video_processor is None:
            return clip
        size = fed_frame_size(self.video_processor, len(clip.frames), *clip.size)
        if size is None:
            return clip
        if size == clip.size:
            return clip
        resample = getattr(self.video_processor, "resample", None)
        resample = resample if isinstance(resample, int) else 3  # 3: PIL's BICUBIC
        return Clip(tuple(f.resize(size, resample) for f in clip.frames), clip.fps, clip.indices, clip.total_frames)

    def load(self, value: Any) -> Clip:
        """A row's clip (any form `vlm_grpo.media.clips.load_clip` reads), sampled and sized by this budget."""
        return self.fit(load_clip(value, self.frame_indices))


def video_processor_of(processor: Any) -> Any:
    """The processor's video processor, or None when it takes no videos."""
    return getattr(processor, "video_processor", None)


def apply_video_budget(
    processor: Any,
    *,
    fps: float | None = None,
    max_frames: int | None = None,
    num_frames: int | None = None,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    source: str = "VLMGRPOConfig",
    log: bool = True,
) -> VideoBudget:
    """Put a video budget where it acts and return the :class:`VideoBudget` clips are loaded with for `processor`.

    Pixel bounds given (not None) are written into the video processor's own budget (with `log`, a changed value is
    logged as set by `source`); frame settings given replace the defaults (2 fps, at most 16 frames).
    """
    check_pixel_budget(min_pixels, max_pixels)
    check_frame_sampling(fps, max_frames, num_frames)
    video_processor = video_processor_of(processor)
    if video_processor is not None and (min_pixels is not None or max_pixels is not None):
        changed = update_size_budget(video_processor.size, min_pixels, max_pixels, prefix="video_")
        for name, (old, value) in changed.items() if log else ():
            logger.warning(
                "%s.%s=%d replaces the video processor's %d (video_processor.size[%r]); the processor keeps the new "
                "value and is saved with it.", source, name, value, old, _KEYS[name],
            )  # fmt: skip
    elif video_processor is None and log and (min_pixels is not None or max_pixels is not None):
        logger.warning("%s takes no videos, so %s's video pixel budget does nothing.", type(processor).__name__, source)
    settings = {"fps": fps, "max_frames": max_frames, "num_frames": num_frames}
    return VideoBudget(**{k: v for k, v in settings.items() if v is not None}, video_processor=video_processor)


@contextmanager
def video_budget_for_call(
    processor: Any,
    video_fps: float | None = None,
    video_max_frames: int | None = None,
    video_num_frames: int | None = None,
    video_min_pixels: int | None = None,
    video_max_pixels: int | None = None,
) -> Iterator[VideoBudget]:
    """:func:`apply_video_budget` for the duration of a `with` block (evaluation), with `VLMGRPOConfig`'s names: the
    video processor's own pixel budget is put back afterwards, and nothing is logged."""
    video_processor = video_processor_of(processor)
    before = {k: video_processor.size[k] for k in _KEYS.values()} if video_processor is not None else None
    try:
        yield apply_video_budget(
            processor, fps=video_fps, max_frames=video_max_frames, num_frames=video_num_frames,
            min_pixels=video_min_pixels, max_pixels=video_max_pixels, log=False,
        )  # fmt: skip
    finally:
        for key, value in (before or {}).items():  # item assignment: a dict or a SizeDict, by release
            video_processor.size[key] = value
