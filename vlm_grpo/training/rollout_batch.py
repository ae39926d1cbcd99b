"""TRL's scored rollout batches (what `GRPOTrainer._generate_and_score_completions` returns): some rows kept, and
several batches joined into one. Dynamic sampling (`vlm_grpo.training.dynamic_sampling`) builds its batch this way.

A batch is a dict of per-row tensors whose widths depend on the batch: prompts left-padded to the longest prompt,
completions right-padded to the longest completion, and `token_type_ids` / `mm_token_type_ids` spanning both. Joining
batches pads each part to the widest, the way TRL pads one batch (the same pad values; padding is masked), and lays
the vision tensors out as the processor would for those rows (`vlm_grpo.media.batch_layout.ImageLayout`). A key this
module does not know how to split or pad raises `LayoutUnknown`, never a silently misaligned batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..media.batch_layout import ImageLayout, LayoutUnknown

__all__ = ["concat_rollouts", "loss_token_count", "select_rollouts"]

# Per-token tensors aligned with the prompt (left-padded) or the completion (right-padded), with TRL's pad values;
# None: the tokenizer's pad token.
_PROMPT_ALIGNED = {"prompt_ids": None, "prompt_mask": 0}
_COMPLETION_ALIGNED = {"completion_ids": None, "completion_mask": 0, "old_per_token_logps": 0.0,
                       "ref_per_token_logps": 0.0, "sampling_per_token_logps": 0.0, "tool_mask": 1,
                       "importance_sampling_ratio": 0.0}  # fmt: skip
# Per-token tensors over prompt + completion (TRL extends the processor's with zeros for the completion).
_SEQUENCE_ALIGNED = ("token_type_ids", "mm_token_type_ids")
# Recomputed for the joined batch by the caller (a count over every process: `loss_token_count`, gathered).
_BATCH_SCALARS = ("num_items_in_batch",)


def _rows(batch: dict[str, Any]) -> int:
    return batch["prompt_ids"].shape[0]


def select_rollouts(batch: dict[str, Any], rows: Sequence[int]) -> dict[str, Any]:
    """The rows `rows` of a scored rollout batch, in that order, vision tensors included (`num_items_in_batch`, a
    count over the whole batch, is left out)."""
    n_rows, rows = _rows(batch), list(rows)
    images_per_row = batch.get("num_images") or [0] * n_rows
    layout = ImageLayout.of(batch, images_per_row)
    out: dict[str, Any] = layout.vision_inputs(batch, rows) if layout is not None else {}
    for key, value in batch.items():
        if key in out or key in _BATCH_SCALARS:
            continue
        if isinstance(value, list):  # num_images, num_tiles: one entry per row
            if len(value) != n_rows:
                raise LayoutUnknown(
                    f"Cannot tell how the list {key!r} of {len(value)} entries splits over {n_rows} rows."
                )
            out[key] = [value[r] for r in rows]
        elif isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == n_rows:
            out[key] = value[rows]
        else:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise LayoutUnknown(f"Cannot tell how {key!r} ({shape}) splits over {n_rows} rows.")
    return {key: out[key] for key in batch if key in out}  # TRL's key order: its splitting reads the first one


def _pad_to(value: torch.Tensor, width: int, pad: float, left: bool) -> torch.Tensor:
    missing = width - value.shape[1]
    if missing == 0:
        return value
    padding = (0, 0) * (value.dim() - 2) + ((missing, 0) if left else (0, missing))
    return F.pad(value, padding, value=pad)


def concat_rollouts(parts: Sequence[dict[str, Any]], pad_token_id: int) -> dict[str, Any]:
    """Scored rollout batches (as `select_rollouts` returns them) joined into one: rows in order, each part padded to
    the widest prompt and completion."""
    if not parts:
        raise ValueError("concat_rollouts needs at least one batch.")
    keys = set(parts[0])
    for part in parts[1:]:
        if set(part) != keys:
            raise LayoutUnknown(f"Rollout batches with different keys cannot be joined: {sorted(keys ^ set(part))}.")
    prompt_width = max(part["prompt_ids"].shape[1] for part in parts)
    completion_width = max(part["completion_ids"].shape[1] for part in parts)
    out: dict[str, Any] = {}
    for key in parts[0]:
        values = [part[key] for part in parts]
        if isinstance(values[0], list):
            out[key] = [item for value in values for item in value]
        elif key in _PROMPT_ALIGNED:
            pad = pad_token_id if _PROMPT_ALIGNED[key] is None else _PROMPT_ALIGNED[key]
            out[key] = torch.cat([_pad_to(v, prompt_width, pad, left=True) for v in values])
        elif key in _COMPLETION_ALIGNED:
            out[key] = _cat_completion_aligned(key, parts, values, completion_width, pad_token_id)
        elif key in _SEQUENCE_ALIGNED:
            # [rows, prompt + completion]: each part split where its prompt ends, each side padded like its tokens.
            pieces = []
            for part, value in zip(parts, values, strict=True):
                width = part["prompt_ids"].shape[1]
                prompt, completion = value[:, :width], value[:, width:]
                pieces.append(torch.cat([_pad_to(prompt, prompt_width, 0, left=True),
                                         _pad_to(completion, completion_width, 0, left=False)], dim=1))  # fmt: skip
            out[key] = torch.cat(pieces)
        else:
            out[key] = _cat_rows(key, values)
    return out


def _cat_completion_aligned(
    key: str, parts: Sequence[dict[str, Any]], values: list[torch.Tensor], width: int, pad_token_id: int
) -> torch.Tensor:
    """Per-token tensors of the completions, right-padded to `width`; a per-sequence one (`[rows, 1]`, e.g. TRL's
    sequence-level importance ratio) joined as it is."""
    widths = [part["completion_ids"].shape[1] for part in parts]
    if all(v.shape[1] == w for v, w in zip(values, widths, strict=True)):
        pad = pad_token_id if _COMPLETION_ALIGNED[key] is None else _COMPLETION_ALIGNED[key]
        return torch.cat([_pad_to(v, width, pad, left=False) for v in values])
    if all(v.shape[1] == 1 for v in values):
        return torch.cat(values)
    raise LayoutUnknown(f"{key!r} of widths {[v.shape[1] for v in values]} matches neither the completions' "
                        f"{widths} nor one value per row.")  # fmt: skip


def _cat_rows(key: str, values: list[torch.Tensor]) -> torch.Tensor:
    """Row-wise (or image-wise) tensors joined along dim 0. Idefics3's `pixel_values [rows, images, C, H, W]` (and its
    `pixel_attention_mask`) hold as many images per row as the batch's most: padded with all-zero images, as its
    processor pads."""
    trailing = {tuple(v.shape[1:]) for v in values}
    if len(trailing) > 1:
        if key not in ("pixel_values", "pixel_attention_mask") or len({v.dim() for v in values}) > 1:
            raise LayoutUnknown(f"Cannot join {key!r} of shapes {sorted(trailing)}.")
        if len({s[1:] for s in trailing}) > 1:  # only the images-per-row dimension may differ
            raise LayoutUnknown(f"Cannot join {key!r} of shapes {sorted(trailing)}.")
        most = max(v.shape[1] for v in values)
        values = [_pad_to(v, most, 0, left=False) for v in values]
    return torch.cat(values)


def loss_token_count(batch: dict[str, Any]) -> torch.Tensor:
    """The completion tokens of `batch` that enter the loss (TRL's `num_items_in_batch` before it is gathered)."""
    mask = batch["completion_mask"]
    if "tool_mask" in batch:
        mask = mask * batch["tool_mask"]
    return mask.sum()
