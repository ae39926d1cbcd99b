"""LFM2-VL's image processor without torchvision, for one tile per image.

transformers ships LFM2-VL's image processor only as a torchvision class, so `AutoProcessor` cannot build the processor
where torchvision is missing (every CPU-only pip install of torch). `Lfm2VlImageProcessorPil` is its PIL variant for
images shown whole, as one tile (`do_image_splitting=False`, the tiny models' and small images' case): the family's
`smart_resize` to multiples of patch x downsample within the token budget, rescale and normalise, patches flattened in
the order the SigLIP2 encoder reads them and padded to the budget's patch count, with the mask and the patch grid
(`pixel_values`, `pixel_attention_mask`, `spatial_shapes`), as the torchvision class returns them for one tile.

Splitting large images into tiles (the checkpoints' default for images over a tile) is not here: a processor asked to
split is refused with the fix named (install torchvision, or show each image whole), never a silently different
input. Checkpoints are saved with the real class name, so transformers with torchvision loads its own.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np
from transformers.image_processing_backends import PilBackend
from transformers.image_processing_utils import BatchFeature
from transformers.image_utils import IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD, PILImageResampling, SizeDict
from transformers.processing_utils import ImagesKwargs

__all__ = ["Lfm2VlImageProcessorPil"]


class Lfm2VlImagesKwargs(ImagesKwargs, total=False):
    """The settings LFM2-VL's image processor takes (those of the torchvision class)."""

    downsample_factor: int
    do_image_splitting: bool
    min_tiles: int
    max_tiles: int
    use_thumbnail: bool
    min_image_tokens: int
    max_image_tokens: int
    encoder_patch_size: int
    tile_size: int
    max_pixels_tolerance: float
    return_row_col_info: bool


def smart_resize(height: int, width: int, factor: int, min_tokens: int, max_tokens: int, patch: int) -> tuple[int, int]:
    """LFM2-VL's `smart_resize`: sides rounded to multiples of `patch * factor`, the area held between `min_tokens`
    and `max_tokens` image tokens (each token `factor`² patches of `patch`² pixels).

    >>> smart_resize(30, 34, 2, 1, 4, 8)
    (32, 32)
    """
    unit = patch * factor
    h_bar, w_bar = max(unit, round(height / unit) * unit), max(unit, round(width / unit) * unit)
    if h_bar * w_bar > max_tokens * unit * unit:
        beta = math.sqrt(height * width / (max_tokens * unit * unit))
        h_bar = max(unit, math.floor(height / beta / unit) * unit)
        w_bar = max(unit, math.floor(width / beta / unit) * unit)
    elif h_bar * w_bar < min_tokens * unit * unit:
        beta = math.sqrt(min_tokens * unit * unit / (height * width))
        h_bar, w_bar = math.ceil(height * beta / unit) * unit, math.ceil(width * beta / unit) * unit
    return h_bar, w_bar


class Lfm2VlImageProcessorPil(PilBackend):
    """LFM2-VL's image processor in PIL and numpy, one tile per image (see the module docstring)."""

    downsample_factor = 2
    do_image_splitting = False
    min_tiles = 2
    max_tiles = 10
    use_thumbnail = True
    min_image_tokens = 64
    max_image_tokens = 256
    encoder_patch_size = 16
    tile_size = 512
    max_pixels_tolerance = 2.0
    do_resize = True
    size: ClassVar[dict[str, int]] = {"height": 512, "width": 512}
    resample = PILImageResampling.BILINEAR
    do_rescale = True
    rescale_factor = 1 / 255
    do_normalize = True
    do_pad = True
    return_row_col_info = False
    image_mean = IMAGENET_STANDARD_MEAN
    image_std = IMAGENET_STANDARD_STD
    valid_kwargs = Lfm2VlImagesKwargs
    model_input_names: ClassVar[list[str]] = ["pixel_values", "pixel_attention_mask", "spatial_shapes"]

    def to_dict(self) -> dict[str, Any]:
        """The settings as the torchvision class saves them (its name, so transformers with torchvision loads its
        own)."""
        out = super().to_dict()
        out["image_processor_type"] = "Lfm2VlImageProcessor"
        return out

    def _preprocess(self, images: list[Any], resample: Any, do_rescale: bool, rescale_factor: float,
                    do_normalize: bool, image_mean: Any, image_std: Any, downsample_factor: int,
                    do_image_splitting: bool, min_image_tokens: int, max_image_tokens: int, encoder_patch_size: int,
                    return_row_col_info: bool = False, return_tensors: Any = None, **kwargs: Any) -> BatchFeature:  # fmt: skip
        if do_image_splitting:
            raise ValueError(
                "This LFM2-VL processor splits images into tiles (do_image_splitting=True), which needs transformers' "
                "torchvision image processor: install torchvision matching your torch, or set "
                "processor.image_processor.do_image_splitting = False to show each image whole, as one tile."
            )
        patch = encoder_patch_size
        max_patches = max_image_tokens * downsample_factor**2
        pixel_values, masks, shapes, sizes = [], [], [], []
        for image in images:  # channel-first arrays
            height, width = image.shape[-2:]
            new_h, new_w = smart_resize(height, width, downsample_factor, min_image_tokens, max_image_tokens, patch)
            image = self.resize(image, SizeDict(height=new_h, width=new_w), resample=resample)
            if do_rescale:
                image = self.rescale(image, rescale_factor)
            if do_normalize:
                image = self.normalize(image, image_mean, image_std)
            channels = image.shape[0]
            grid = (new_h // patch, new_w // patch)
            patches = image.reshape(channels, grid[0], patch, grid[1], patch).transpose(1, 3, 2, 4, 0)
            patches = patches.reshape(grid[0] * grid[1], -1)
            mask = np.zeros(max_patches, dtype=np.int32)
            mask[: len(patches)] = 1
            padding = np.zeros((max_patches - len(patches), patches.shape[1]), patches.dtype)
            pixel_values.append(np.concatenate([patches, padding]).astype(np.float32))
            masks.append(mask)
            shapes.append(list(grid))
            sizes.append([new_h, new_w])
        data = {"pixel_values": np.stack(pixel_values), "pixel_attention_mask": np.stack(masks),
                "spatial_shapes": np.array(shapes, dtype=np.int64)}  # fmt: skip
        if return_row_col_info:
            data.update(image_rows=[1] * len(images), image_cols=[1] * len(images), image_sizes=sizes)
        return BatchFeature(data=data, tensor_type=return_tensors)
