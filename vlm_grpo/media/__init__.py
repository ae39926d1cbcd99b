"""Images and clips, from what a dataset row holds to what the model takes.

The floors of this package, each using only those below it:
- `columns`: where a row holds its media (`image` / `images`, `video` / `videos`), a row's images and clips as lists;
- `images` (load, normalise to upright 8-bit RGB) and `clips` (frames from lists, arrays, folders or video files);
- `pixel_budget` (image area: the processor's own budget where it keeps one, images fitted once) and `video_budget`
  (which frames of a clip, at what size);
- `row_media.load_row_media`: the one call a row makes for its media, loaded and fitted (`vlm_grpo.data.rows` places
  them in the prompt); `checks.drop_unreadable_rows`: the rows whose media cannot be read, found before training;
- `processor` (processors that load without torchvision; `video_processor`, Qwen-VL's video processor in PIL) and
  `processing` (prompts with images and clips through the processor in one call; TRL has no video path);
- `batch_layout`: each family's vision tensors sliced per row and the GRPO groups of a batch, for the fast paths.

Names are imported on first use, so `import vlm_grpo.media` costs nothing.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Clip": "clips",
    "ImageError": "images",
    "PixelBudget": "pixel_budget",
    "RowMedia": "row_media",
    "VideoBudget": "video_budget",
    "VideoError": "clips",
    "load_clip": "clips",
    "load_image": "images",
    "load_processor": "processor",
    "load_row_media": "row_media",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
