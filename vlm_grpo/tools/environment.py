"""`ImageTools`: crop, zoom and rotate the rollout's image, as a TRL environment (`environment_factory=ImageTools`).

TRL makes one environment per rollout and calls `reset(**row)` with the dataset row before generating, so each rollout's
tools act on its own row's image. Every public method is a tool: its name, type hints and Google-style docstring are
the schema the chat template shows the model (transformers' `get_json_schema`). A tool returns TRL's multimodal tool
response, the new image and a line of text; one that cannot do what it was asked raises `ValueError`, which TRL
returns to the model as `{"error": ...}` and counts in `tools/failure_frequency`.

The coordinate frame is the pixels of the image `reset` received: under `VLMGRPOTrainer`, the row's first image after
the trainer fitted it to the pixel budget (`max_pixels`), the image the prompt shows; x right, y down, (0, 0) the
top-left corner, `x2` / `y2` exclusive (`vlm_grpo.tools.limits`). Each result's text names the size it came from.
`crop` and `zoom` cut from the image as the dataset holds it where the budget shrank it (the trainer keeps it for them,
`vlm_grpo.data.rows.source_images`): the box is mapped onto it, so a zoom shows detail the prompt's image lost, as
DeepEyes' zoom-in tool does.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from PIL import Image

from ..data.rows import source_images
from ..media.images import load_rgb_images
from .crop import crop_image
from .limits import MAX_PIXELS
from .rotate import rotate_image
from .zoom import zoom_image

__all__ = ["TOOL_NAMES", "ImageTools", "image_tools"]


class _ImageEnvironment:
    """The row's image and the pixel budget: everything an image tool needs but the tool itself."""

    max_pixels: int = MAX_PIXELS  # the largest image a tool returns (width x height)

    def __init__(self) -> None:
        self._image: Image.Image | None = None
        self._original: Image.Image | None = None  # the row's image before the pixel budget shrank it, if it did

    def reset(self, **row: Any) -> None:
        """Take the row's first image (`images`, as `VLMGRPOTrainer` and TRL pass it, or `image`); the prompt is left
        as it is. Raises `ValueError` for a row without one: the tools would have nothing to act on."""
        value = row.get("images") if row.get("images") is not None else row.get("image")
        images = load_rgb_images(value)
        if not images:
            raise ValueError(
                "ImageTools needs an image in every row, and this row has none (no `image` or `images`, or an empty "
                "list). Drop the text-only rows, or give text tools with `tools=[...]` instead."
            )
        self._image = images[0]
        originals = source_images(row)
        larger = originals and originals[0].width * originals[0].height > self._image.width * self._image.height
        self._original = originals[0] if larger else None  # loaded and normalised by the trainer already

    def _origin(self) -> str:
        """What a crop or zoom answer adds when it was cut from the original."""
        return (
            "" if self._original is None else f" (cut from the {self._original.width}x{self._original.height} original)"
        )

    def _result(self, image: Image.Image, text: str) -> list[dict[str, Any]]:
        """TRL's multimodal tool response: the image, then what it is."""
        return [{"type": "image", "image": image}, {"type": "text", "text": text}]

    def _source(self) -> Image.Image:
        if self._image is None:  # TRL resets every environment before generating; a direct call may not have
            raise RuntimeError("ImageTools.reset(**row) must be called with the row before its tools.")
        return self._image


class ImageTools(_ImageEnvironment):
    """Image tools over the rollout's image: `crop`, `zoom`, `rotate`. Pass the class as TRL's `environment_factory`;
    `image_tools(names)` makes one with only some of them, or another pixel budget."""

    def crop(self, x1: int, y1: int, x2: int, y2: int) -> list:
        """Crop the image to a box, to look at that region alone.

        Args:
            x1: left edge of the box, in pixels from the image's left side.
            y1: top edge of the box, in pixels from the image's top.
            x2: right edge of the box (exclusive), in pixels from the image's left side.
            y2: bottom edge of the box (exclusive), in pixels from the image's top.
        """
        image = self._source()
        out = crop_image(image, x1, y1, x2, y2, self.max_pixels, source=self._original)
        return self._result(out, f"Crop ({x1}, {y1}, {x2}, {y2}) of the {image.width}x{image.height} image"
                                 f"{self._origin()}: {out.width}x{out.height} pixels.")  # fmt: skip

    def zoom(self, x1: int, y1: int, x2: int, y2: int, factor: float = 2) -> list:
        """Crop the image to a box and enlarge it, to see small details.

        Args:
            x1: left edge of the box, in pixels from the image's left side.
            y1: top edge of the box, in pixels from the image's top.
            x2: right edge of the box (exclusive), in pixels from the image's left side.
            y2: bottom edge of the box (exclusive), in pixels from the image's top.
            factor: how many times larger to make the box, from 1 to 8.
        """
        image = self._source()
        out = zoom_image(image, x1, y1, x2, y2, factor, self.max_pixels, source=self._original)
        return self._result(out, f"Zoom x{factor} of ({x1}, {y1}, {x2}, {y2}) of the {image.width}x{image.height} "
                                 f"image{self._origin()}: {out.width}x{out.height} pixels.")  # fmt: skip

    def rotate(self, degrees: float) -> list:
        """Rotate the whole image, e.g. to read sideways text.

        Args:
            degrees: angle to turn the image counter-clockwise, e.g. 90.
        """
        image = self._source()
        out = rotate_image(image, degrees, self.max_pixels)
        return self._result(out, f"The {image.width}x{image.height} image rotated {degrees} degrees "
                                 f"counter-clockwise: {out.width}x{out.height} pixels.")  # fmt: skip


TOOL_NAMES: tuple[str, ...] = ("crop", "zoom", "rotate")


def image_tools(names: str | Iterable[str] | None = None, max_pixels: int = MAX_PIXELS) -> type[_ImageEnvironment]:
    """An environment class (for `environment_factory`) with only the image tools `names` (a list, or a comma-separated
    string as a command line gives it: `"crop,zoom"`; None: all of `TOOL_NAMES`) and `max_pixels` as the largest image
    a tool returns. TRL shows the model every public method of the environment, so the others are left out of the class.

    >>> env = image_tools("crop,zoom")()
    >>> [name for name in TOOL_NAMES if hasattr(env, name)]
    ['crop', 'zoom']
    """
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    chosen = list(dict.fromkeys(TOOL_NAMES if names is None else names))
    unknown = [n for n in chosen if n not in TOOL_NAMES]
    if unknown or not chosen:
        raise ValueError(f"Unknown image tool(s) {unknown or chosen}: choose from {', '.join(TOOL_NAMES)}.")
    if max_pixels <= 0:
        raise ValueError(f"max_pixels must be positive, got {max_pixels}.")
    members = {name: ImageTools.__dict__[name] for name in chosen}
    members.update(max_pixels=max_pixels, __doc__=f"Image tools {', '.join(chosen)} over the rollout's image.")
    return type("ImageTools", (_ImageEnvironment,), members)
