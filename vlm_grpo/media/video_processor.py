"""Qwen-VL's video processor without torchvision: the same outputs from PIL, numpy and torch.

transformers' video processors (`Qwen2VLVideoProcessor`, `Qwen3VLVideoProcessor`) subclass a torchvision backend and
cannot be built where torchvision is missing (every CPU-only pip install of torch), and transformers ships no PIL
variant of them as it does of the image processors. `QwenVideoProcessorPil` is that variant: it resizes frames with
the family's own `smart_resize` (`vlm_grpo.media.video_budget.fed_frame_size`), rescales and normalises them the way the
torchvision backend does (the mean and std fused with the rescale factor, in float32) and lays the patches out with
the same view and permutation, so `pixel_values_videos` and `video_grid_thw` match the torchvision processor's for
frames that need no resizing (the case in training: `vlm_grpo.media.video_budget.VideoBudget.fit` sizes frames first).

It never samples frames: the processor is called with the frames the video budget kept (`do_sample_frames=False`),
and it returns their `video_metadata` for the processor's temporal positions (Qwen2.5-VL's `second_per_grid_ts`) and
frame timestamps (Qwen3-VL). `vlm_grpo.media.processor` attaches it to the Qwen processors it builds without torchvision;
checkpoints are saved with the real class name, so plain transformers with torchvision loads its own.
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar

import numpy as np
import torch
from PIL import Image

from .video_budget import fed_frame_size

__all__ = ["VIDEO_KEYS", "QwenVideoProcessorPil"]

# Settings a Qwen video processor is configured by (saved in processor_config.json's "video_processor").
VIDEO_KEYS = (
    "size", "patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std", "do_resize", "do_rescale",
    "rescale_factor", "do_normalize", "do_convert_rgb", "resample",
)  # fmt: skip
# Each family's defaults, as transformers' classes set them (used for settings a checkpoint leaves out).
_DEFAULTS = {
    "Qwen2VLVideoProcessor": {
        "size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768}, "patch_size": 14,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    },
    "Qwen3VLVideoProcessor": {
        "size": {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768}, "patch_size": 16,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    },
}  # fmt: skip
_COMMON = {
    "temporal_patch_size": 2, "merge_size": 2, "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255,
    "do_normalize": True, "do_convert_rgb": True, "resample": 3,
}  # fmt: skip
# Keywords the processor forwards to every video processor call, and which of them this one can honour.
_IGNORED = {"return_metadata", "return_tensors", "video_metadata", "do_sample_frames", "device", "data_format",
            "input_data_format", "cap_pixels_per_frame"}  # fmt: skip


def _valid_kwargs() -> Any:
    from transformers.processing_utils import VideosKwargs

    return VideosKwargs


class QwenVideoProcessorPil:
    """A Qwen2/2.5/3-VL video processor that needs no torchvision (see the module docstring).

    Args:
        video_processor_type: the transformers class it stands in for (`Qwen2VLVideoProcessor`, which Qwen2.5-VL uses
            too, or `Qwen3VLVideoProcessor`); it picks the pixel-budget rule and the defaults, and is the name saved.
        **settings: the video processor's settings (`size`, `patch_size`, `merge_size`, ...; see `VIDEO_KEYS`).
    """

    model_input_names: ClassVar[list[str]] = ["pixel_values_videos", "video_grid_thw"]

    def __init__(self, video_processor_type: str, **settings: Any) -> None:
        if video_processor_type not in _DEFAULTS:
            raise ValueError(f"{video_processor_type!r} is not a Qwen-VL video processor ({', '.join(_DEFAULTS)}).")
        self.video_processor_type = video_processor_type
        values = {**_COMMON, **_DEFAULTS[video_processor_type]}
        values.update({k: v for k, v in settings.items() if k in VIDEO_KEYS and v is not None})
        for key in VIDEO_KEYS:
            setattr(self, key, copy.deepcopy(values[key]))
        self.size = dict(self.size)
        if not {"shortest_edge", "longest_edge"} <= set(self.size):
            raise ValueError(f"size must hold 'shortest_edge' and 'longest_edge' pixel bounds, got {self.size}.")

    @property
    def valid_kwargs(self) -> Any:
        """The keywords a processor may route to a video processor (transformers' `VideosKwargs`)."""
        return _valid_kwargs()

    @classmethod
    def from_dict(cls, config: dict[str, Any], video_processor_type: str | None = None) -> QwenVideoProcessorPil:
        """Built from a saved `video_processor` config (its `video_processor_type` unless one is given)."""
        kind = video_processor_type or config.get("video_processor_type")
        return cls(kind, **{k: v for k, v in config.items() if k in VIDEO_KEYS})

    def to_dict(self) -> dict[str, Any]:
        """The settings as transformers saves a video processor's, under the real class name."""
        return {**{k: copy.deepcopy(getattr(self, k)) for k in VIDEO_KEYS},
                "video_processor_type": self.video_processor_type}  # fmt: skip

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.to_dict()})"

    def __call__(self, videos: Any, **kwargs: Any) -> Any:
        """`pixel_values_videos` and `video_grid_thw` for `videos` (a list of clips, each a list of frames or a
        T x H x W x C array), and their `video_metadata` with `return_metadata=True`."""
        from transformers.feature_extraction_utils import BatchFeature
        from transformers.video_utils import make_batched_metadata, make_batched_videos

        if kwargs.get("do_sample_frames"):
            raise ValueError(
                "QwenVideoProcessorPil does not sample frames: pass the frames to use with do_sample_frames=False "
                "(vlm_grpo.media.video_budget.VideoBudget picks them)."
            )
        if kwargs.get("cap_pixels_per_frame"):
            raise ValueError("cap_pixels_per_frame=True needs transformers' torchvision video processor.")
        unknown = {k for k, v in kwargs.items() if v is not None and k not in _IGNORED and not hasattr(self, k)}
        if unknown:
            raise ValueError(f"QwenVideoProcessorPil does not take {sorted(unknown)}.")
        settings = {k: kwargs.get(k) if kwargs.get(k) is not None else getattr(self, k) for k in VIDEO_KEYS}
        clips = make_batched_videos(videos)
        metadata = make_batched_metadata(clips, video_metadata=kwargs.get("video_metadata"))
        patches, grids = [], []
        for clip in clips:
            pixels, grid = self._patches(np.asarray(clip), settings)
            patches.append(pixels)
            grids.append(grid)
        data = {"pixel_values_videos": torch.cat(patches), "video_grid_thw": torch.tensor(grids)}
        if kwargs.get("return_metadata"):
            data["video_metadata"] = metadata
        return BatchFeature(data=data, tensor_type=kwargs.get("return_tensors"),
                            skip_tensor_conversion=["video_metadata"])  # fmt: skip

    def _patches(self, frames: np.ndarray, settings: dict[str, Any]) -> tuple[torch.Tensor, list[int]]:
        if frames.ndim != 4:
            raise ValueError(f"a clip must be T x H x W x C frames, got shape {frames.shape}")
        if frames.shape[-1] not in (1, 3, 4) and frames.shape[1] in (1, 3, 4):  # T x C x H x W
            frames = frames.transpose(0, 2, 3, 1)
        images = [Image.fromarray(np.ascontiguousarray(f[..., 0] if f.shape[-1] == 1 else f)) for f in frames]
        if settings["do_convert_rgb"]:
            images = [im.convert("RGB") for im in images]
        height, width = images[0].height, images[0].width
        if settings["do_resize"]:
            probe = _Settings(settings, self.video_processor_type)
            width, height = fed_frame_size(probe, len(images), width, height)
            images = [im if im.size == (width, height) else im.resize((width, height), settings["resample"])
                      for im in images]  # fmt: skip
        video = torch.from_numpy(np.stack([np.asarray(im) for im in images])).permute(0, 3, 1, 2)  # T, C, H, W
        video = video.to(torch.float32)
        mean, std = torch.tensor(settings["image_mean"]), torch.tensor(settings["image_std"])
        if settings["do_rescale"] and settings["do_normalize"]:  # fused, as the torchvision backend does
            video = (video - (mean / settings["rescale_factor"])[:, None, None]) / (std / settings["rescale_factor"])[
                :, None, None
            ]
        elif settings["do_normalize"]:
            video = (video - mean[:, None, None]) / std[:, None, None]
        elif settings["do_rescale"]:
            video = video * settings["rescale_factor"]
        return _patchify(video, settings["patch_size"], settings["merge_size"], settings["temporal_patch_size"])

    def get_num_of_video_patches(
        self, num_frames: int, height: int, width: int, videos_kwargs: dict[str, Any] | None = None
    ) -> int:
        """Patches (before merging) a clip of `num_frames` frames of `height` x `width` becomes."""
        width, height = fed_frame_size(self, num_frames, width, height)
        frames = -(-num_frames // self.temporal_patch_size)
        return frames * (height // self.patch_size) * (width // self.patch_size)


class _Settings:
    """A call's settings in the shape `fed_frame_size` reads a video processor."""

    def __init__(self, settings: dict[str, Any], video_processor_type: str) -> None:
        self.__dict__.update(settings)
        self.video_processor_type = video_processor_type


def _patchify(video: torch.Tensor, patch: int, merge: int, temporal: int) -> tuple[torch.Tensor, list[int]]:
    """Flat patches of one `[T, C, H, W]` clip, laid out as transformers' Qwen video processors lay them out."""
    if pad := -video.shape[0] % temporal:  # the last frame repeated, as transformers pads
        video = torch.cat([video, video[-1:].expand(pad, -1, -1, -1)])
    frames, channels, height, width = video.shape
    grid_t, grid_h, grid_w = frames // temporal, height // patch, width // patch
    patches = video.view(1, grid_t, temporal, channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
    patches = patches.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    flat = patches.reshape(grid_t * grid_h * grid_w, channels * temporal * patch * patch)
    return flat, [grid_t, grid_h, grid_w]
