"""Tools for multi-turn rollouts with TRL's tool API (`tools=`, `environment_factory=`), images in and out.

- `ImageTools` (`environment`): crop, zoom and rotate the rollout's own image, a TRL environment
  (`environment_factory=ImageTools`); `image_tools("crop,zoom")` picks some of them. The single operations are
  `crop_image`, `zoom_image`, `rotate_image`, their checks and limits in `limits`.
- `templates`: a chat template that renders tools, installed for Qwen2-VL / Qwen2.5-VL (whose shipped templates do not)
  when a trainer is given tools, and the response parser for TRL to read their tool calls.
- `rollouts`: what `VLMGRPOTrainer` fixes on TRL's tool path (see its docstring).

See docs/tools.md.
"""

from __future__ import annotations

from .crop import crop_image
from .environment import TOOL_NAMES, ImageTools, image_tools
from .limits import MAX_PIXELS
from .rotate import rotate_image
from .zoom import MAX_FACTOR, zoom_image

__all__ = [
    "MAX_FACTOR",
    "MAX_PIXELS",
    "TOOL_NAMES",
    "ImageTools",
    "crop_image",
    "image_tools",
    "rotate_image",
    "zoom_image",
]
