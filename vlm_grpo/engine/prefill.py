"""The prefill of a fast-generation call: each distinct prompt in full (`full_prefill`), or, at a tool turn, each row
continuing the KV cache of the call before, only what was appended prefilled (`TurnCache`).

In a multi-turn tool rollout TRL hands the generator, at each later turn, the whole conversation so far: the prompt,
the completion that called the tool and the tool's reply (its image included). Prefilling all of it again runs the
prompt's image through the vision tower and recomputes every token the previous call already holds in its cache.
`TurnCache` keeps that call's static cache and, for each row whose new prompt extends one of its rows (the same ids,
with the same trainable weights), copies that row's keys and values out and prefills only the new tokens: the
completion's end-of-turn token, the tool's reply and its new image, whose vision features alone are computed.
Positions come from the model over the whole conversation, so Qwen's 3-D rotary positions continue past the new image
exactly as a full prefill gives them; the new image's pixels are the last of the row's.

Served: models whose every cache layer holds keys and values over the whole sequence (Qwen2-VL, Qwen2.5-VL, Qwen3-VL),
image rows without clips, each row of a call distinct. Not Qwen3.5's recurrent layers, whose state has run on past the
end of each completion, nor sliding windows. Anything else, or a row that extends nothing, prefills in full as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..compat import cache_kwarg
from ..media.batch_layout import left_padded, select_rows
from ..private_api import generation_position_ids

__all__ = ["Prefill", "TurnCache", "full_prefill"]

_KV_LAYERS = ("DynamicLayer", "StaticLayer")  # whole-sequence keys and values (not sliding, not recurrent state)
_VISION = {"pixel_values", "image_grid_thw"}
_PER_TOKEN = {"mm_token_type_ids", "token_type_ids"}


def _fingerprint(model: nn.Module) -> tuple[int, ...]:
    """The in-place version counters of the weights training changes (the trainable ones; in a frozen copy, its
    adapters, else every weight): the same tuple means the same weights produced the cache (a LoRA merge into the
    frozen base while generating is not counted). The caller also forgets the cache at every optimizer step."""
    named = list(model.named_parameters())
    weights = [p for _, p in named if p.requires_grad] or [p for n, p in named if "lora_" in n]
    return tuple(p._version for p in (weights or [p for _, p in named]))


def _image_runs(ids: torch.Tensor, image_token: int) -> int:
    """How many images `ids` hold: runs of the placeholder id. Not the start tokens: a random model samples any id,
    and a sampled vision-start token opens no image."""
    pads = ids == image_token
    return int(pads[0]) + int((pads[1:] & ~pads[:-1]).sum())


def _first_images(fields: dict[str, Any], count: int) -> tuple[torch.Tensor, ...] | None:
    """The pixels and grid of a row's first `count` images (its processor outputs), or None if it has fewer."""
    if not count:
        return ()
    grid = fields.get("image_grid_thw")
    if grid is None or len(grid) < count:
        return None
    return fields["pixel_values"][: int(grid[:count].prod(-1).sum())], grid[:count]


@dataclass
class Prefill:
    """What a prefill leaves for the decode loop: one row per distinct prompt (per row, when appended)."""

    cache: Any  # a DynamicCache: every row's keys and values, left-padded to `width`
    logits: torch.Tensor  # [rows, vocab]: each row's last position
    input_ids: torch.Tensor  # [rows, width], left-padded with the pad id
    attention_mask: torch.Tensor  # [rows, width]
    positions: torch.Tensor  # the position ids a full prefill of the rows would use ([..., rows, width])
    prefilled_tokens: int  # tokens that ran through the model (a full prefill: every row's whole prompt)


def full_prefill(
    model: nn.Module, prompt_ids: list[list[int]], fields: dict[str, Any], width: int, pad_id: int, device: torch.device
) -> Prefill:
    """Prefill `prompt_ids` (one row each, `fields` their processor outputs) left-padded to `width`, with the position
    ids `generate` would use (Qwen's 3-D rotary positions included)."""
    from transformers import DynamicCache

    input_ids, kwargs = left_padded(prompt_ids, fields, width, pad_id, device)
    positions = generation_position_ids(model, input_ids, kwargs)
    cache = kwargs[cache_kwarg(model)] = DynamicCache(config=model.config)
    out = model(input_ids=input_ids, position_ids=positions, use_cache=True, logits_to_keep=1, **kwargs)
    prefilled = int(kwargs["attention_mask"].sum())
    return Prefill(cache, out.logits[:, -1], input_ids, kwargs["attention_mask"], positions, prefilled)


class TurnCache:
    """The previous fast-generation call's cache, kept for the next call's rows that extend its rows."""

    def __init__(self) -> None:
        self._last: dict[str, Any] | None = None

    def forget(self) -> None:
        """Drop the kept cache (its memory goes with the decode caches' own bookkeeping)."""
        self._last = None

    def remember(
        self,
        model: nn.Module,
        cache: Any,
        width: int,
        prompt_ids: Sequence[Sequence[int]],
        completions: list[list[int]],
        groups: tuple[dict[str, Any], list[int], list[int]],
    ) -> None:
        """After a call: `cache` holds row r's prompt left-padded to `width` and, after it, the keys and values of
        every completion token but the last sampled one (never fed back). `groups`: the call's distinct prompts'
        processor outputs, their image counts, and each row's distinct prompt (the ids alone do not tell two image
        rows apart: an image is the same run of placeholder ids whatever its pixels)."""
        layers = getattr(cache, "layers", [])
        if not layers or any(type(layer).__name__ not in _KV_LAYERS for layer in layers):
            self._last = None
            return
        fields, images_per_row, inverse = groups
        if not set(fields) <= _VISION | _PER_TOKEN | {"attention_mask"}:
            self._last = None
            return
        vision = [
            _first_images(select_rows(fields, images_per_row, [u], None), n) for u, n in enumerate(images_per_row)
        ]
        rows: dict[tuple[int, ...], list] = {}
        for row, (prompt, completion) in enumerate(zip(prompt_ids, completions, strict=True)):
            if completion:
                key = tuple(prompt) + tuple(completion[:-1])
                rows.setdefault(key, []).append((row, len(prompt), images_per_row[inverse[row]], vision[inverse[row]]))
        self._last = {"cache": cache, "width": width, "rows": rows, "version": _fingerprint(model),
                      "lengths": sorted({len(key) for key in rows})}  # fmt: skip

    def _match(self, ids: list[int], row_fields: dict[str, Any]) -> tuple[int, int, int] | None:
        """(cached row, its prompt length, tokens cached) of the longest cached row `ids` extends with the same
        images, or None."""
        last = self._last
        for length in reversed(last["lengths"]):
            for row, prompt_len, images, vision in (
                last["rows"].get(tuple(ids[:length]), []) if length < len(ids) else []
            ):
                mine = _first_images(row_fields, images)
                if mine is not None and all(torch.equal(a.to(b.device), b) for a, b in zip(mine, vision, strict=True)):
                    return row, prompt_len, length
        return None

    def prefill(
        self,
        model: nn.Module,
        prompt_ids: list[list[int]],
        fields: dict[str, Any],
        images_per_row: list[int],
        videos_per_row: list[int],
        pad_id: int,
        device: torch.device,
    ) -> Prefill | None:
        """The rows' prefill from the kept cache plus their new tokens, or None (prefill in full) unless every row
        extends a cached row and the model and fields are ones this serves. `fields` holds one row per prompt, each
        left-padded to the longest. The kept cache is forgotten either way: the call about to run reuses it."""
        try:
            return self._prefill(model, prompt_ids, fields, images_per_row, videos_per_row, pad_id, device)
        finally:
            self._last = None

    def _prefill(self, model, prompt_ids, fields, images_per_row, videos_per_row, pad_id, device) -> Prefill | None:
        if any(videos_per_row) or not set(fields) <= _VISION | _PER_TOKEN | {"attention_mask"}:
            return None
        if self._last is None or self._last["version"] != _fingerprint(model):
            return None
        per_row = [select_rows(fields, images_per_row, [row], None) for row in range(len(prompt_ids))]
        matches = [self._match(ids, row_fields) for ids, row_fields in zip(prompt_ids, per_row, strict=True)]
        if any(match is None for match in matches):
            return None
        from transformers import DynamicCache

        last, start_token = self._last, getattr(model.config, "vision_start_token_id", None)
        image_token = getattr(model.config, "image_token_id", None)
        width = max(len(ids) for ids in prompt_ids)
        layers = len(last["cache"].layers)
        keys, values, logits, positions, prefilled = [[] for _ in range(layers)], [[] for _ in range(layers)], [], [], 0
        for row, (ids, (old, prompt_len, cached)) in enumerate(zip(prompt_ids, matches, strict=True)):
            full_ids, full_kwargs = left_padded([ids], per_row[row], len(ids), pad_id, device)
            position = generation_position_ids(model, full_ids, full_kwargs)  # the whole conversation's positions
            new = full_ids[:, cached:]
            if images_per_row[row] and (start_token is None or image_token is None):
                return None  # the families whose images open with a start token (Qwen-VL, GLM-4V): tested here
            new_images = _image_runs(new[0], image_token) if images_per_row[row] else 0
            if new_images and "image_grid_thw" not in full_kwargs:
                return None
            kwargs = {"attention_mask": torch.ones(1, len(ids), dtype=torch.long, device=device)}
            for name, value in full_kwargs.items():
                if name in _PER_TOKEN:
                    kwargs[name] = value[:, cached:]
            if new_images:  # the new images are the row's last ones: their patches the last of its pixel values
                grid = full_kwargs["image_grid_thw"][-new_images:]
                kwargs["image_grid_thw"] = grid
                kwargs["pixel_values"] = full_kwargs["pixel_values"][-int(grid.prod(-1).sum()) :]
            past = DynamicCache(config=model.config)
            old_width = last["width"]
            span = slice(old_width - prompt_len, old_width - prompt_len + cached)  # the row's prompt, then completion
            for index, layer in enumerate(last["cache"].layers):
                past.update(layer.keys[old : old + 1, :, span], layer.values[old : old + 1, :, span], index)
            kwargs[cache_kwarg(model)] = past
            out = model(input_ids=new, position_ids=position[..., cached:], use_cache=True, logits_to_keep=1, **kwargs)
            prefilled += new.shape[1]
            pad = width - len(ids)
            for index, layer in enumerate(past.layers):  # left-padded to the call's width, as a full prefill is
                keys[index].append(nn.functional.pad(layer.keys, (0, 0, pad, 0)))
                values[index].append(nn.functional.pad(layer.values, (0, 0, pad, 0)))
            logits.append(out.logits[:, -1])
            positions.append(nn.functional.pad(position, (pad, 0), value=1))
        cache = DynamicCache(config=model.config)
        for index in range(layers):
            cache.update(torch.cat(keys[index]), torch.cat(values[index]), index)
        input_ids, kwargs = left_padded(prompt_ids, {}, width, pad_id, device)
        return Prefill(cache, torch.cat(logits), input_ids, kwargs["attention_mask"],
                               torch.cat(positions, dim=-2), prefilled)  # fmt: skip
