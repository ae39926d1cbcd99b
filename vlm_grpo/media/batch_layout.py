"""The GRPO groups of a batch, and each row's slice of the processor's vision tensors: one answer for both fast paths.

TRL repeats every prompt `num_generations` times; fast generation prefills each group once and shared-prefix scoring
packs each group into one row. Both ask the same two questions of a batch, answered here once:

1. **Where does a row's image data live?** Each family's processor lays its vision tensors out its own way:
   - Qwen2/2.5/3-VL: flattened patches, `pixel_values [patches, dim]`, with `image_grid_thw [images, 3]`
     (`grid.prod()` patches per image);
   - Gemma 3: one entry per image, `pixel_values [images, C, H, W]` (LLaVA-style `image_sizes [images, 2]` alike:
     Mistral 3's Pixtral pads every image to the batch's largest; InternVL's tiles when an image is one tile);
   - InternVL with tiled images: `pixel_values [tiles, C, H, W]`, each row's tiles given by TRL's `num_tiles`;
   - LLaVA-OneVision: one entry per image, `pixel_values [images, views, C, H, W]` (a base view and its tiles, padded
     to the batch's most views) with `image_sizes [images, 2]`;
   - Idefics3 / SmolVLM: one entry per row, `pixel_values [rows, max images, C, H, W]` with `pixel_attention_mask`.
   Clips (Qwen-VL) lie alike: `pixel_values_videos [patches, dim]` with `video_grid_thw [clips, 3]` and, for
   Qwen2.5-VL, `second_per_grid_ts [clips]`.
   `ImageLayout` records each row's ranges along dim 0, whatever the layout.
2. **Which rows are a group?** Rows with the same prompt tokens *and the same images and clips*, where the same means
   identical pixels as the processor fed them (what the model sees), compared as tensors. Rows may come shuffled.
   Before processing, `prompt_key` tells repeated chat prompts apart by their text and their images' and clips'
   pixels, so the processor can run once per distinct prompt (`distinct_prompts`; `select_rows` then repeats its
   outputs).
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = [
    "PER_IMAGE_KEYS",
    "VIDEO_KEYS",
    "ImageLayout",
    "LayoutUnknown",
    "as_tensors",
    "distinct_prompts",
    "group_rows",
    "prompt_key",
    "select_rows",
]

# Processor outputs with one entry per image (Qwen's image_grid_thw, Gemma 3's pixel_values, LLaVA's image_sizes).
PER_IMAGE_KEYS = ("pixel_values", "image_grid_thw", "image_sizes", "spatial_shapes")
# Processor outputs for clips (Qwen-VL): patches, one grid per clip, and Qwen2.5-VL's seconds per temporal step.
VIDEO_KEYS = ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


class LayoutUnknown(ValueError):
    """The processor outputs are laid out in a way this module cannot split over rows (callers take TRL's path)."""


def _starts(counts: Sequence[int]) -> list[int]:
    starts = [0]
    for count in counts:
        starts.append(starts[-1] + count)
    return starts


@dataclass(frozen=True)
class ImageLayout:
    """Where each row's images live in a batch's vision tensors: contiguous ranges along dim 0.

    `pixel_ranges` index `pixel_values` (and `pixel_attention_mask`): patch rows for Qwen, images for Gemma 3, rows
    for Idefics3. `image_ranges` index per-image tensors (`image_grid_thw`, `image_sizes`). `video_pixel_ranges`
    index `pixel_values_videos` (patch rows), `video_ranges` the per-clip `video_grid_thw` / `second_per_grid_ts`.
    `keys` is what two rows must share besides their pixels to hold the same images and clips: the counts, and
    Qwen's grids (and clip timing).
    """

    pixel_ranges: list[tuple[int, int]]
    image_ranges: list[tuple[int, int]]
    keys: list[tuple]
    video_pixel_ranges: list[tuple[int, int]] | None = None
    video_ranges: list[tuple[int, int]] | None = None

    @classmethod
    def of(
        cls, fields: dict[str, Any], images_per_row: Sequence[int], videos_per_row: Sequence[int] | None = None
    ) -> ImageLayout | None:
        """The layout of `fields` (the processor's outputs for the batch), or None when there are no images or
        clips. `videos_per_row`: each row's clips (None: none)."""
        rows = len(images_per_row)
        videos_per_row = list(videos_per_row) if videos_per_row is not None else [0] * rows
        images = cls._images(fields, images_per_row)
        if not sum(videos_per_row):
            return images
        if fields.get("pixel_values_videos") is None or fields.get("video_grid_thw") is None:
            raise LayoutUnknown("rows with clips but no pixel_values_videos / video_grid_thw")
        if images is None:
            empty = [(0, 0)] * rows
            images = cls(empty, empty, [(0,)] * rows)
        clip_starts = _starts(videos_per_row)
        video_ranges = [(clip_starts[r], clip_starts[r + 1]) for r in range(rows)]
        grids = [tuple(g) for g in torch.as_tensor(fields["video_grid_thw"]).tolist()]
        if len(grids) != clip_starts[-1]:
            raise LayoutUnknown(f"{len(grids)} video grids for {clip_starts[-1]} clips")
        timing = fields.get("second_per_grid_ts")
        timing = (
            [round(float(t), 6) for t in torch.as_tensor(timing).reshape(-1).tolist()] if timing is not None else None
        )
        patch_starts = _starts([t * h * w for t, h, w in grids])
        video_pixel_ranges = [(patch_starts[a], patch_starts[b]) for a, b in video_ranges]
        keys = [
            (*key, tuple(grids[a:b]), tuple(timing[a:b]) if timing is not None else None)
            for key, (a, b) in zip(images.keys, video_ranges)
        ]
        return cls(images.pixel_ranges, images.image_ranges, keys, video_pixel_ranges, video_ranges)

    @classmethod
    def _images(cls, fields: dict[str, Any], images_per_row: Sequence[int]) -> ImageLayout | None:
        pixel_values = fields.get("pixel_values")
        if pixel_values is None or not sum(images_per_row):
            return None
        rows = len(images_per_row)
        image_starts = _starts(images_per_row)
        image_ranges = [(image_starts[r], image_starts[r + 1]) for r in range(rows)]
        counts = [(n,) for n in images_per_row]
        grid = fields.get("image_grid_thw")
        tiles = fields.get("num_tiles")
        if tiles is not None and grid is None and fields.get("spatial_shapes") is None:
            # InternVL's tiled images, pixel_values [tiles, C, H, W]: each row's tiles as TRL counts them (`num_tiles`).
            tiles = [int(t) for t in tiles]
            if len(tiles) != rows or pixel_values.size(0) != sum(tiles):
                raise LayoutUnknown(f"{len(tiles)} tile counts ({sum(tiles)} tiles) for {rows} rows of "
                                    f"{pixel_values.size(0)} pixel_values entries")  # fmt: skip
            tile_starts = _starts(tiles)
            tile_ranges = [(tile_starts[r], tile_starts[r + 1]) for r in range(rows)]
            return cls(tile_ranges, image_ranges, [(n, t) for n, t in zip(images_per_row, tiles)])
        if grid is not None:  # Qwen: grid.prod() patch rows per image
            if fields.get("pixel_attention_mask") is not None:
                raise LayoutUnknown("pixel_attention_mask with image_grid_thw is not a known layout")
            grids = [tuple(g) for g in torch.as_tensor(grid).tolist()]
            patch_starts = _starts([t * h * w for t, h, w in grids])
            pixel_ranges = [(patch_starts[a], patch_starts[b]) for a, b in image_ranges]
            return cls(pixel_ranges, image_ranges, [tuple(grids[a:b]) for a, b in image_ranges])
        if pixel_values.dim() == 5 and fields.get("image_sizes") is not None:  # LLaVA-OneVision: an entry per image
            if pixel_values.size(0) != image_starts[-1]:  # (its base view and tiles, padded to the batch's most)
                raise LayoutUnknown(f"5-D pixel_values of {pixel_values.size(0)} entries for {image_starts[-1]} images")
            return cls(image_ranges, image_ranges, counts)
        if pixel_values.dim() == 5:  # Idefics3: one entry per row, padded with all-zero images
            if pixel_values.size(0) != rows:
                raise LayoutUnknown(f"5-D pixel_values of {pixel_values.size(0)} entries for {rows} rows")
            return cls([(r, r + 1) for r in range(rows)], image_ranges, counts)
        if pixel_values.size(0) == image_starts[-1]:  # Gemma 3 / LLaVA / LFM2-VL's one tile: one entry per image
            return cls(image_ranges, image_ranges, counts)
        raise LayoutUnknown(f"pixel_values of shape {tuple(pixel_values.shape)} is not a known layout")

    def same_images(self, fields: dict[str, Any], pairs: Sequence[tuple[int, int]]) -> list[bool]:
        """For each `(row, other)` pair: whether their images and clips are pixel-identical (read back in one device
        sync)."""
        tensors = [(fields.get("pixel_values"), self.pixel_ranges)]
        if fields.get("pixel_attention_mask") is not None:
            tensors.append((fields["pixel_attention_mask"], self.pixel_ranges))
        if fields.get("image_sizes") is not None:  # Pixtral / LLaVA pad pixels to the batch's largest image
            tensors.append((fields["image_sizes"], self.image_ranges))
        if self.video_pixel_ranges is not None:
            tensors.append((fields["pixel_values_videos"], self.video_pixel_ranges))
        tensors = [(torch.as_tensor(t), ranges) for t, ranges in tensors if t is not None]
        different = torch.zeros((), dtype=torch.bool, device=tensors[0][0].device)
        checks = []
        for row, other in pairs:
            if self.keys[row] != self.keys[other]:
                checks.append(different)
                continue
            check = torch.ones((), dtype=torch.bool, device=different.device)
            for values, ranges in tensors:
                a, b = values[slice(*ranges[row])], values[slice(*ranges[other])]
                check = check & (a == b).all() if a.shape == b.shape else different
            checks.append(check)
        return torch.stack(checks).tolist() if checks else []

    def vision_inputs(self, fields: dict[str, Any], rows: Sequence[int]) -> dict[str, torch.Tensor]:
        """The vision tensors of `rows` (in this order), in the batch's own layout. A set of rows without images (or
        clips) gets none of their tensors: the models take an absent tensor, not an empty one, for "none"."""
        out = {}
        named = [("pixel_values", self.pixel_ranges), ("pixel_attention_mask", self.pixel_ranges),
                 ("spatial_shapes", self.pixel_ranges), ("image_grid_thw", self.image_ranges),
                 ("image_sizes", self.image_ranges)]  # fmt: skip
        if self.video_ranges is not None:
            named += [("pixel_values_videos", self.video_pixel_ranges), ("video_grid_thw", self.video_ranges),
                      ("second_per_grid_ts", self.video_ranges)]  # fmt: skip
        for name, ranges in named:
            value = fields.get(name)
            if value is not None:
                value = torch.as_tensor(value)
                out[name] = torch.cat([value[slice(*ranges[r])] for r in rows]) if rows else value[:0]
        if self.video_ranges is not None:
            for name, ranges in (("pixel_values", self.image_ranges), ("pixel_values_videos", self.video_ranges)):
                if not sum(ranges[r][1] - ranges[r][0] for r in rows):  # no image / no clip among these rows
                    keys = VIDEO_KEYS if name == "pixel_values_videos" else ("pixel_values", "image_grid_thw")
                    for key in keys:
                        out.pop(key, None)
        return out


def group_rows(
    keys: Sequence[Hashable], layout: ImageLayout | None = None, fields: dict[str, Any] | None = None
) -> list[list[int]]:
    """The groups of a batch: rows with equal `keys` (their prompt) and, with a layout, pixel-identical images.

    Groups come in the order of their first row, each listing its rows in batch order.

    >>> group_rows([(1, 2), (1, 2), (3,), (1, 2)])
    [[0, 1, 3], [2]]
    """
    candidates: dict[Hashable, list[int]] = {}
    for row, key in enumerate(keys):
        candidates.setdefault((key, layout.keys[row] if layout else None), []).append(row)
    groups = list(candidates.values())
    if layout is None:
        return groups
    # The same prompt tokens (hence image counts and grids) need not be the same images: split off the rows whose
    # pixels differ from their group's first row until every group is verified.
    verified: list[list[int]] = []
    while groups:
        pairs = [(row, group[0]) for group in groups for row in group[1:]]
        same = dict(zip(pairs, layout.same_images(fields, pairs)))
        remaining = []
        for group in groups:
            verified.append([row for row in group if same.get((row, group[0]), True)])
            rest = [row for row in group if not same.get((row, group[0]), True)]
            if rest:
                remaining.append(rest)
        groups = remaining
    return sorted(verified, key=lambda group: group[0])


def as_tensors(fields: dict[str, Any]) -> dict[str, Any]:
    """The processor outputs as TRL treats them: tensors as they are, per-token lists kept (TRL left-pads them),
    anything else made a tensor."""
    return {
        key: value
        if isinstance(value, torch.Tensor) or (isinstance(value, list) and value and isinstance(value[0], list))
        else torch.as_tensor(np.asarray(value))
        for key, value in fields.items()
    }


def select_rows(
    fields: dict[str, Any],
    images_per_row: Sequence[int],
    rows: Sequence[int],
    videos_per_row: Sequence[int] | None = None,
) -> dict[str, Any]:
    """The processor outputs (as TRL's `_tokenize_prompts` returns them) of `rows`, in that order (a row may repeat).

    Vision tensors are sliced by their `ImageLayout` (`videos_per_row`: each row's clips, None for none); other per-row
    tensors by row, per-token lists (`mm_token_type_ids`, `token_type_ids`) row by row.
    """
    fields = as_tensors(fields)
    layout = ImageLayout.of(fields, images_per_row, videos_per_row)
    n_rows, n_images = len(images_per_row), sum(images_per_row)
    out = layout.vision_inputs(fields, rows) if layout is not None else {}
    for key, value in fields.items():
        if key in out or (
            layout is not None and layout.video_ranges is not None and key in (*VIDEO_KEYS, *PER_IMAGE_KEYS)
        ):
            continue
        if not isinstance(value, torch.Tensor):
            out[key] = [value[row] for row in rows]  # per-row (per-token) lists
        elif key in PER_IMAGE_KEYS and value.shape[0] == n_images:  # a batch without images: empty tensors
            out[key] = value[:0]
        elif value.shape[0] == n_rows:
            out[key] = value[list(rows)]
        else:
            raise LayoutUnknown(f"Cannot tell how {key!r} of shape {tuple(value.shape)} splits over {n_rows} rows.")
    return out


def _image_key(image: Any) -> bytes | None:
    """A digest of a PIL image's pixels (equal pixels, equal keys); None for anything else."""
    if not (hasattr(image, "tobytes") and hasattr(image, "size") and hasattr(image, "mode")):
        return None
    return hashlib.blake2b(f"{image.mode}{image.size}".encode() + image.tobytes(), digest_size=16).digest()


def _clip_key(clip: Any) -> bytes | None:
    """A digest of a clip's frames and timing (`vlm_grpo.media.clips.Clip`); None for anything else."""
    frames = getattr(clip, "frames", None)
    if not isinstance(frames, tuple) or not all(_image_key(f) is not None for f in frames):
        return None
    digest = hashlib.blake2b(f"{clip.fps}{clip.indices}{clip.total_frames}".encode(), digest_size=16)
    for frame in frames:
        digest.update(_image_key(frame))
    return digest.digest()


def prompt_key(prompt: Any) -> Hashable | None:
    """A key equal for chat prompts with the same messages and pixel-identical PIL images and clips; None when a part
    is of a kind it cannot compare (the caller then treats the prompt as distinct).

    >>> prompt_key([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    (('user', (('text', 'hi'),)),)
    """
    if isinstance(prompt, str):
        return prompt
    key = []
    for message in prompt:
        content = message.get("content")
        if isinstance(content, str):
            key.append((message.get("role"), content))
            continue
        parts = []
        for part in content or []:
            if part.get("type") in ("image", "video"):
                kind = part["type"]
                digest = (_image_key if kind == "image" else _clip_key)(part.get(kind))
                if digest is None:
                    return None
                parts.append((kind, digest))
            elif part.get("type") == "text" and isinstance(part.get("text"), str) and set(part) <= {"type", "text"}:
                parts.append(("text", part["text"]))
            else:
                return None
        key.append((message.get("role"), tuple(parts)))
    return tuple(key)


def distinct_prompts(prompts: Sequence[Any]) -> tuple[list[int], list[int]] | None:
    """`(unique, inverse)` over chat prompts by `prompt_key`: the first row of each distinct prompt, and for every row
    the position of its prompt in `unique`. None when a prompt holds a part `prompt_key` cannot compare.

    >>> distinct_prompts(["a", "b", "a"])
    ([0, 1], [0, 1, 0])
    """
    keys = [prompt_key(prompt) for prompt in prompts]
    if any(key is None for key in keys):
        return None
    positions: dict[Hashable, int] = {}
    unique, inverse = [], []
    for row, key in enumerate(keys):
        if key not in positions:
            positions[key] = len(unique)
            unique.append(row)
        inverse.append(positions[key])
    return unique, inverse


def group_prompts(
    prompt_ids: Sequence[Sequence[int]],
    images_per_row: Sequence[int],
    fields: dict[str, Any],
    videos_per_row: Sequence[int] | None = None,
) -> tuple[list[int], list[int]]:
    """Find identical prompts: the same token ids and pixel-identical images and clips (`batch_layout.group_rows`).

    Returns `(unique, inverse)`: the batch index of each distinct prompt's first row, and for every row the
    position of its prompt in `unique`, so `unique[inverse[i]]` is a row identical to row `i`.

    >>> group_prompts([[1, 2], [1, 2], [3]], [0, 0, 0], {})
    ([0, 2], [0, 0, 1])
    """
    fields = as_tensors(fields)
    layout = ImageLayout.of(fields, images_per_row, videos_per_row)
    groups = group_rows([tuple(ids) for ids in prompt_ids], layout, fields)
    inverse = [0] * len(prompt_ids)
    for position, group in enumerate(groups):
        for row in group:
            inverse[row] = position
    return [group[0] for group in groups], inverse


def left_padded(
    prompt_ids: Sequence[Sequence[int]], fields: dict[str, Any], width: int, pad_id: int, device: torch.device
) -> tuple[torch.Tensor, dict[str, Any]]:
    """`(input_ids, kwargs)` for a forward over `prompt_ids`, left-padded to `width` with `pad_id`: the attention mask
    and `fields` (one row per prompt) on `device` in `kwargs`, per-token lists (`mm_token_type_ids`, `token_type_ids`)
    left-padded like the ids.

    >>> ids, kwargs = left_padded([[5, 6], [7]], {}, 3, 0, torch.device("cpu"))
    >>> ids.tolist(), kwargs["attention_mask"].tolist()
    ([[0, 5, 6], [0, 0, 7]], [[0, 1, 1], [0, 0, 1]])
    """
    rows = len(prompt_ids)
    input_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((rows, width), dtype=torch.long)
    for i, ids in enumerate(prompt_ids):
        input_ids[i, width - len(ids) :] = torch.tensor(ids)
        attention_mask[i, width - len(ids) :] = 1
    kwargs: dict[str, Any] = {"attention_mask": attention_mask.to(device)}
    for key, value in fields.items():
        if isinstance(value, torch.Tensor):
            kwargs[key] = value.to(device)
        else:
            padded = torch.zeros((rows, width), dtype=torch.long)
            for i, tokens in enumerate(value):
                padded[i, width - len(tokens) :] = torch.tensor(tokens)
            kwargs[key] = padded.to(device)
    return input_ids.to(device), kwargs
