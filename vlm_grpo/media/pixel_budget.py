"""The image pixel budget (`min_pixels` / `max_pixels`): where it lives, and how images are fitted to it.

Qwen2-VL, Qwen2.5-VL and Qwen3-VL processors resize every image by a pixel budget themselves: ``smart_resize`` to
sides that are multiples of patch x merge size, with an area between ``image_processor.size["shortest_edge"]`` and
``size["longest_edge"]`` pixels. For them those two settings *are* the budget, and nothing else keeps a copy:

- ``FastBaseVisionModel.from_pretrained(min_pixels=, max_pixels=)`` writes them, as
  ``AutoProcessor.from_pretrained(..., min_pixels=, max_pixels=)`` does;
- ``VLMGRPOConfig.min_pixels`` / ``max_pixels``, when set, overwrite them for training (a changed value is logged,
  and checkpoints save the processor with it); ``evaluate``'s arguments do so for one call;
- images are resized once, to the size the processor's own ``smart_resize`` gives (:meth:`PixelBudget.fit`), so the
  processor then resizes nothing, and vLLM, which runs its own processor without our settings, sees the same image.

Other processors have no pixel budget: Gemma 3 resizes every image to a fixed square, Idefics3 / SmolVLM its longest
edge to ``size["longest_edge"]`` before cutting tiles. For them the budget is ours alone: images are fitted to it
before the processor (:func:`fit_pixel_budget`), which bounds the detail the model sees but not the
image tokens (the processor's own settings fix those). ``from_pretrained`` refuses a budget for them, since their
processor cannot keep one.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from PIL import Image

from ..families import FAMILIES
from ..validation import is_int

__all__ = [
    "PixelBudget",
    "apply_pixel_budget",
    "check_pixel_budget",
    "fed_size",
    "fit_pixel_budget",
    "pixel_budget_for_call",
    "processor_pixel_budget",
    "resizes_by_pixel_budget",
    "set_processor_pixel_budget",
    "update_size_budget",
]

logger = logging.getLogger(__name__)

# The packages of the image processors (PIL and torchvision) that resize by a pixel budget, from the family records
# (`vlm_grpo.families`): Qwen2-VL's, which Qwen2.5-VL and Qwen3-VL checkpoints use too. An image processor carries
# no model type, so it is recognised by where its class (or a base class) is defined.
_BUDGET_MODULES = tuple(
    sorted({f"transformers.models.{f.image_package}." for f in FAMILIES.values() if f.pixel_budget})
)
# The families without a budget of ours whose processors refuse elongated images, by image processor module.
_ASPECT_LIMITS = {f"transformers.models.{f.image_package}.": f.max_aspect_ratio for f in FAMILIES.values()
                  if f.max_aspect_ratio is not None}  # fmt: skip
# Where those processors keep the budget: size["shortest_edge"] is min_pixels, size["longest_edge"] max_pixels.
_KEYS = {"min_pixels": "shortest_edge", "max_pixels": "longest_edge"}


def _image_processor(processor: Any) -> Any:
    return getattr(processor, "image_processor", processor)


def _budget_class(image_processor: Any) -> type | None:
    return next((c for c in type(image_processor).__mro__ if c.__module__.startswith(_BUDGET_MODULES)), None)


def resizes_by_pixel_budget(processor: Any) -> bool:
    """Whether `processor` (or its image processor) resizes every image by a pixel budget of its own (Qwen-VL)."""
    return _budget_class(_image_processor(processor)) is not None


def processor_pixel_budget(processor: Any) -> tuple[int, int] | None:
    """`(min_pixels, max_pixels)` the processor resizes every image into, or None when it has no pixel budget."""
    if not resizes_by_pixel_budget(processor):
        return None
    size = _image_processor(processor).size
    return int(size["shortest_edge"]), int(size["longest_edge"])


def set_processor_pixel_budget(
    processor: Any, min_pixels: int | None = None, max_pixels: int | None = None
) -> dict[str, tuple[int, int]]:
    """Write a pixel budget into a processor that resizes by one; a bound given as None keeps the processor's value.

    Returns the values that changed, ``{"max_pixels": (old, new), ...}``. Raises ValueError for a processor without a
    pixel budget (naming what to do instead), or when the resulting budget is invalid (min above max).
    """
    check_pixel_budget(min_pixels, max_pixels)
    if min_pixels is None and max_pixels is None:
        return {}
    current = processor_pixel_budget(processor)
    if current is None:
        name = type(_image_processor(processor)).__name__
        raise ValueError(
            f"{name} has no pixel budget to set: it resizes every image to its own input size (its `size` setting), "
            "so min_pixels / max_pixels here would be lost. Fit images to a budget before it with "
            "VLMGRPOConfig(min_pixels=..., max_pixels=...) for training and evaluate(..., max_pixels=...), or change "
            "the image processor's own `size`."
        )
    return update_size_budget(_image_processor(processor).size, min_pixels, max_pixels)


def update_size_budget(
    size: Any, min_pixels: int | None, max_pixels: int | None, prefix: str = ""
) -> dict[str, tuple[int, int]]:
    """Write the non-None bounds into a Qwen-VL processor's `size` (`shortest_edge` / `longest_edge`, the image or
    the video processor's); returns what changed as ``{"<prefix>max_pixels": (old, new), ...}``. Raises ValueError
    when the combined budget is invalid (min above max); `prefix` names the settings in messages (`video_`)."""
    current = tuple(int(size[key]) for key in _KEYS.values())
    new = dict(zip(_KEYS, current))
    new.update({k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v is not None})
    if new["min_pixels"] > new["max_pixels"]:
        raise ValueError(
            f"{prefix}min_pixels ({new['min_pixels']}) is larger than {prefix}max_pixels ({new['max_pixels']}) once "
            f"combined with the processor's own budget {current}; set both."
        )
    changed = {}
    for (name, key), old in zip(_KEYS.items(), current):
        if new[name] != old:
            size[key] = new[name]  # a dict in some transformers releases, a SizeDict (item assignment too) in others
            changed[prefix + name] = (old, new[name])
    return changed


def fed_size(image_processor: Any, width: int, height: int) -> tuple[int, int] | None:
    """``(width, height)`` a Qwen-VL image processor resizes a ``width`` x ``height`` image to, with its own
    ``smart_resize`` and settings; None for a processor without a pixel budget (Gemma 3, Idefics3)."""
    cls = _budget_class(image_processor)
    if cls is None:
        return None
    smart_resize = sys.modules[cls.__module__].smart_resize
    min_pixels, max_pixels = processor_pixel_budget(image_processor)
    factor = image_processor.patch_size * image_processor.merge_size
    fed_height, fed_width = smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
    return int(fed_width), int(fed_height)


def check_pixel_budget(min_pixels: int | None, max_pixels: int | None) -> None:
    """Raise ValueError unless each bound is None or a positive int and ``min_pixels <= max_pixels``.

    The one validation of a pixel budget: the config, ``from_pretrained``, ``evaluate`` and :func:`fit_pixel_budget`
    all call it.
    """
    for name, value in (("min_pixels", min_pixels), ("max_pixels", max_pixels)):
        if value is not None and (not is_int(value) or value <= 0):
            raise ValueError(f"{name} must be a positive integer or None, got {value!r}.")
    if min_pixels is not None and max_pixels is not None and min_pixels > max_pixels:
        raise ValueError(f"min_pixels ({min_pixels}) is larger than max_pixels ({max_pixels}).")


def fit_pixel_budget(img: Image.Image, min_pixels: int | None = None, max_pixels: int | None = None) -> Image.Image:
    """Resize ``img`` (aspect ratio kept) so its area ``width * height`` is within ``[min_pixels, max_pixels]``.

    Both sides are scaled by one factor and rounded toward the budget: down when shrinking, so the area never
    exceeds ``max_pixels``; up when growing, so it reaches ``min_pixels``, unless the two bounds are closer than one
    row of pixels, where ``max_pixels`` wins. A side never drops below 1 pixel, so a very elongated image keeps 1 pixel
    on its short side and has its long side cut to ``max_pixels``. ``None`` means no bound.

    Returns a copy when ``img`` is already inside the budget, else a BICUBIC resize; ``img`` is never modified.
    For processors that resize by a budget themselves (Qwen-VL), :class:`vlm_grpo.media.pixel_budget.PixelBudget` fits
    images with the processor's own rule instead.
    """
    check_pixel_budget(min_pixels, max_pixels)
    size = _budget_size(img.width, img.height, min_pixels, max_pixels)
    return img.copy() if size == img.size else img.resize(size, Image.Resampling.BICUBIC)


def _budget_size(width: int, height: int, min_pixels: int | None, max_pixels: int | None) -> tuple[int, int]:
    area = width * height
    if max_pixels is not None and area > max_pixels:
        scale = math.sqrt(max_pixels / area)
        new_width, new_height = max(1, math.floor(width * scale)), max(1, math.floor(height * scale))
    elif min_pixels is not None and area < min_pixels:
        scale = math.sqrt(min_pixels / area)
        new_width, new_height = math.ceil(width * scale), math.ceil(height * scale)
    else:
        return width, height
    if max_pixels is not None and new_width * new_height > max_pixels:
        # A side held at 1 pixel, or rounding up past a max_pixels just above min_pixels: cut the longer side.
        if new_width >= new_height:
            new_width = max(1, max_pixels // new_height)
        else:
            new_height = max(1, max_pixels // new_width)
    return new_width, new_height


@dataclass(frozen=True)
class PixelBudget:
    """The budget images are held to before they reach the processor, and who applies it.

    `image_processor` is set when the processor resizes by this budget itself (its settings are then the budget and
    `min_pixels` / `max_pixels` a copy for reading); None when the budget is ours alone (or there is none).
    `max_aspect_ratio`: where the budget is ours, the most elongated image the processor takes
    (`Family.max_aspect_ratio`), or None.
    """

    min_pixels: int | None = None
    max_pixels: int | None = None
    image_processor: Any = None
    max_aspect_ratio: float | None = None

    def fit(self, image: Image.Image) -> Image.Image:
        """`image` at the size the model is fed: the processor's own `smart_resize` size where it resizes by a budget
        (so it resizes nothing itself), else fitted to `min_pixels` / `max_pixels` (aspect kept). Never modified."""
        if self.image_processor is None:
            return fit_pixel_budget(image, self.min_pixels, self.max_pixels)
        size = fed_size(self.image_processor, image.width, image.height)
        if size == image.size:
            return image
        resample = getattr(self.image_processor, "resample", None)
        return image.resize(size, resample if isinstance(resample, int) else Image.Resampling.BICUBIC)

    def refusal(self, width: int, height: int) -> str | None:
        """Why the processor would refuse a `width` x `height` image, or None. Qwen-VL's and GLM-4V's `smart_resize`
        raise for an aspect ratio over 200:1; the dataset check asks here, so such a row is skipped up front instead
        of ending the run at the batch that holds it."""
        if self.max_aspect_ratio is not None and max(width, height) > self.max_aspect_ratio * min(width, height):
            return (f"the processor cannot take this {width}x{height} image (an aspect ratio over "
                    f"{self.max_aspect_ratio:g}:1); crop or pad it to a less elongated shape")  # fmt: skip
        if self.image_processor is None:
            return None
        try:
            fed_size(self.image_processor, width, height)
        except ValueError as error:
            return (f"the processor cannot take this {width}x{height} image ({error}); crop or pad it to a less "
                    "elongated shape")  # fmt: skip
        return None


def apply_pixel_budget(
    processor: Any,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    *,
    source: str = "VLMGRPOConfig",
    log: bool = True,
) -> PixelBudget:
    """Put a budget where it acts and return the :class:`PixelBudget` images are fitted with before `processor`.

    A processor that resizes by a budget gets the non-None bounds written into it (with `log`, a changed value is
    logged as set by `source`); otherwise the budget is ours to apply, and with `log` a warning says that it bounds
    image detail, not the image tokens, which such processors fix themselves.
    """
    check_pixel_budget(min_pixels, max_pixels)
    if resizes_by_pixel_budget(processor):
        changed = set_processor_pixel_budget(processor, min_pixels, max_pixels)
        for name, (old, new) in changed.items() if log else ():
            logger.warning(
                "%s.%s=%d replaces the processor's %s=%d (image_processor.size[%r]); the processor keeps the new value "
                "and is saved with it.", source, name, new, name, old, _KEYS[name],
            )  # fmt: skip
        return PixelBudget(*processor_pixel_budget(processor), image_processor=_image_processor(processor))
    if log and (min_pixels is not None or max_pixels is not None):
        logger.warning(
            "%s resizes every image to its own input size, so %s's min_pixels=%s / max_pixels=%s bound the detail of "
            "each image (it is resized to the budget first) but not its image tokens; set the image processor's own "
            "`size` for those.", type(_image_processor(processor)).__name__, source, min_pixels, max_pixels,
        )  # fmt: skip
    module = type(_image_processor(processor)).__module__
    limit = next((ratio for prefix, ratio in _ASPECT_LIMITS.items() if module.startswith(prefix)), None)
    return PixelBudget(min_pixels, max_pixels, max_aspect_ratio=limit)


@contextmanager
def pixel_budget_for_call(
    processor: Any, min_pixels: int | None = None, max_pixels: int | None = None
) -> Iterator[PixelBudget]:
    """:func:`apply_pixel_budget` for the duration of a `with` block (evaluation): the processor's own budget is put
    back afterwards, and nothing is logged, since nothing is replaced for good."""
    before = processor_pixel_budget(processor)
    try:
        yield apply_pixel_budget(processor, min_pixels, max_pixels, log=False)
    finally:
        if before is not None:
            set_processor_pixel_budget(processor, *before)
