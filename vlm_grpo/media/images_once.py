"""Each distinct image of a rollout batch through the image processor once, however often TRL asks.

TRL's tool loop runs the image processor over every image of every row at each later turn (the prompt's image and
each earlier tool image again), and once more over all of them for scoring; a group's rows repeat the same prompt
image too. For 2 prompts x 8 rollouts of 448² images with two crops each that is 16 + 32 + 48 + 48 images processed
per step, of which 6 are distinct (one original and two crops per prompt, the forced crops alike within a group). On
a 2-core host the processor took 245 ms for 16 originals and 402 ms for 48 images.

`images_processed_once(processor)` puts a memo in front of `processor.image_processor` for one batch (the attribute is
restored after): an image is known by its pixels (mode, size and a digest of its bytes) and the call's keyword
arguments, and the outputs of the images already seen are reused. Only where the result is exactly what one call
over all images gives: image processors whose outputs (`model_input_names`) are per-image patches (`pixel_values`)
and grids (`image_grid_thw`), as Qwen-VL's and GLM-4V's are, asked for as tensors; others are left as they are.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["images_processed_once"]

_OUTPUTS = {"pixel_values", "image_grid_thw"}


@contextlib.contextmanager
def images_processed_once(processor: Any, active: bool = True) -> Iterator[None]:
    """While inside, `processor.image_processor` processes each distinct image once (a no-op where `active` is false
    or the image processor's outputs are not per-image patches and grids)."""
    image_processor = getattr(processor, "image_processor", None)
    if not active or set(getattr(image_processor, "model_input_names", ())) != _OUTPUTS:
        yield
        return
    processor.image_processor = _Memo(image_processor)
    try:
        yield
    finally:
        processor.image_processor = image_processor


def _flat_images(images: Any) -> list[Any] | None:
    """`images` as a flat list of PIL images (a list, or a list of per-row lists), or None for anything else."""
    from PIL import Image

    if not isinstance(images, (list, tuple)):
        return None
    flat = [img for item in images for img in (item if isinstance(item, (list, tuple)) else [item])]
    return flat if flat and all(isinstance(img, Image.Image) for img in flat) else None


def _key(image: Any) -> tuple:
    # A palette image's bytes are indices: its palette and transparency are part of its pixels.
    palette = image.getpalette() if image.mode in ("P", "PA") else None
    digest = hashlib.blake2b(image.tobytes(), digest_size=16)
    digest.update(repr((palette, image.info.get("transparency"))).encode())
    return image.mode, image.size, digest.digest()


class _Memo:
    """The image processor, with each image's patches and grid kept once computed (attributes are the processor's)."""

    def __init__(self, image_processor: Any) -> None:
        self._inner = image_processor
        self._seen: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def __getattr__(self, name: str) -> Any:
        if name == "_inner" or name.startswith("__"):  # not set yet (a copy or unpickling in progress)
            raise AttributeError(name)
        return getattr(self._inner, name)

    def __call__(self, images: Any = None, **kwargs: Any) -> Any:
        flat = _flat_images(images)
        if flat is None or kwargs.get("return_tensors") != "pt":
            return self._inner(images, **kwargs)
        settings = tuple(sorted((name, repr(value)) for name, value in kwargs.items()))
        keys = [(_key(img), settings) for img in flat]
        missing = {key: img for key, img in zip(keys, flat, strict=True) if key not in self._seen}
        if missing:
            out = self._inner(list(missing.values()), **kwargs)
            if set(out.keys()) != _OUTPUTS:  # not what its `model_input_names` said: the processor's own answer
                return self._inner(images, **kwargs)
            sizes = out["image_grid_thw"].prod(-1).tolist()
            for key, pixels, grid in zip(missing, out["pixel_values"].split(sizes), out["image_grid_thw"], strict=True):
                self._seen[key] = (pixels, grid)
        from transformers.feature_extraction_utils import BatchFeature

        pixels, grids = zip(*(self._seen[key] for key in keys), strict=True)
        return BatchFeature({"pixel_values": torch.cat(pixels), "image_grid_thw": torch.stack(grids)})
