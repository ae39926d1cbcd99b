"""The prefill of a fast-generation call: each distinct prompt in full (`full_prefill`), or, at a tool turn, each row
continuing the KV cache of the call before, only what was appended prefilled (`TurnCache`).

In a multi-turn tool rollout TRL hands the generator, at each later turn, the whole conversation so far: the prompt,
the completion that called the tool and the tool's reply (its image included). Prefilling all of it again runs the
prompt's image through the vision tower and recomputes every token the previous call already holds in its cache.
`TurnCache` keeps that call's static cache and, for each row whose new prompt extends one of its rows (the same ids,
with the same trainable weights), copies that row's keys and values out and prefills only the new tokens: the
completion's end-of-turn token, the tool's reply and its new image, whose vision features alone are computed.
All rows append in one forward (`_append_forward`), each padded where its cached tokens and its new tokens are
shorter than the longest, and the result is gathered back to the left-padded layout a full prefill leaves: one
forward per row had cost one launch-bound pass of the whole model per rollout per turn.
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

        last, start_token = self._last, getattr(model.config, "vision_start_token_id", None)
        image_token = getattr(model.config, "image_token_id", None)
        width = max(len(ids) for ids in prompt_ids)
        rows, positions = [], []
        for row, (ids, (old, prompt_len, cached)) in enumerate(zip(prompt_ids, matches, strict=True)):
            full_ids, full_kwargs = left_padded([ids], per_row[row], len(ids), pad_id, device)
            position = generation_position_ids(model, full_ids, full_kwargs)  # the whole conversation's positions
            new = full_ids[0, cached:]
            if images_per_row[row] and (start_token is None or image_token is None):
                return None  # the families whose images open with a start token named so (Qwen-VL): tested here
            new_images = _image_runs(new, image_token) if images_per_row[row] else 0
            if new_images and "image_grid_thw" not in full_kwargs:
                return None
            vision = None
            if new_images:  # the new images are the row's last ones: their patches the last of its pixel values
                grid = full_kwargs["image_grid_thw"][-new_images:]
                vision = (full_kwargs["pixel_values"][-int(grid.prod(-1).sum()) :], grid)
            per_token = {name: value[0, cached:] for name, value in full_kwargs.items() if name in _PER_TOKEN}
            span = slice(last["width"] - prompt_len, last["width"] - prompt_len + cached)  # prompt, then completion
            rows.append(_Appended(old, span, new, position[..., cached:], per_token, vision))
            positions.append(nn.functional.pad(position, (width - len(ids), 0), value=1))
        cache, logits = _append_forward(model, last["cache"], rows, width, pad_id)
        input_ids, kwargs = left_padded(prompt_ids, {}, width, pad_id, device)
        return Prefill(cache, logits, input_ids, kwargs["attention_mask"], torch.cat(positions, dim=-2),
                       sum(len(row.new) for row in rows))  # fmt: skip


@dataclass
class _Appended:
    """One row of a tool turn: the kept row it continues and what it appends."""

    old: int  # the kept cache's row
    span: slice  # that row's cached tokens in the kept cache (its prompt, then its completion)
    new: torch.Tensor  # [new tokens]: the ids to prefill
    positions: torch.Tensor  # [..., 1, new tokens]: their position ids
    per_token: dict[str, torch.Tensor]  # per-token fields (mm_token_type_ids), [new tokens] each
    vision: tuple[torch.Tensor, torch.Tensor] | None  # the new images' pixel values and grid


def _length(row: _Appended) -> int:
    return row.span.stop - row.span.start


def _left_padded_rows(kept: torch.Tensor, rows: list[_Appended], length: int) -> torch.Tensor:
    """Each row's cached slots of `kept` ([rows, heads, slots, dim]) left-padded with zeros to `length`."""
    return torch.cat(
        [nn.functional.pad(kept[r.old : r.old + 1, :, r.span], (0, 0, length - _length(r), 0)) for r in rows]
    )


def _append_forward(model: nn.Module, kept: Any, rows: list[_Appended], width: int, pad_id: int) -> tuple[Any, Any]:
    """One forward for every row's new tokens on its cached keys and values: `(cache, logits)`, the cache holding
    each row's whole conversation left-padded to `width`, as a full prefill leaves it, and each row's last logits.

    Row r is laid out `[pad | cached_r | pad | new_r]` (cached tokens left-padded to the longest, new tokens too): the
    attention mask hides both pads, the position ids are the row's own, so each row attends to exactly what it would
    alone. The result is gathered back to `[pad | cached_r new_r]`."""
    from transformers import DynamicCache

    device = rows[0].new.device
    past_len, new_len = max(_length(row) for row in rows), max(len(row.new) for row in rows)
    input_ids = torch.full((len(rows), new_len), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(rows), past_len + new_len), dtype=torch.long, device=device)
    per_token = {name: torch.zeros_like(input_ids) for name in rows[0].per_token}
    positions = []
    for r, row in enumerate(rows):
        cached, appended = _length(row), len(row.new)
        input_ids[r, new_len - appended :] = row.new
        mask[r, past_len - cached : past_len] = mask[r, past_len + new_len - appended :] = 1
        for name, value in row.per_token.items():
            per_token[name][r, new_len - appended :] = value
        positions.append(nn.functional.pad(row.positions, (new_len - appended, 0), value=1))
    past = DynamicCache(config=model.config)
    for index, layer in enumerate(kept.layers):
        keys, values = (_left_padded_rows(t, rows, past_len) for t in (layer.keys, layer.values))
        past.update(keys, values, index)
    vision = [row.vision for row in rows if row.vision is not None]
    kwargs = {}
    if vision:
        kwargs = {
            "pixel_values": torch.cat([v[0] for v in vision]),
            "image_grid_thw": torch.cat([v[1] for v in vision]),
        }
    out = model(input_ids=input_ids, position_ids=torch.cat(positions, dim=-2), attention_mask=mask, use_cache=True,
                logits_to_keep=1, **{cache_kwarg(model): past}, **per_token, **kwargs)  # fmt: skip
    # Each row's valid slots, in order, left-padded to `width`: slot i of row r reads source slot index[r, i].
    valid = mask.bool()
    lengths = valid.sum(1)
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)  # the valid slots first, in order
    slot = torch.arange(width, device=device) - (width - lengths)[:, None]  # -k: the k-th left pad
    index = order.gather(1, slot.clamp(min=0))
    keep = (slot >= 0)[:, None, :, None]
    cache = DynamicCache(config=model.config)
    for layer_index, layer in enumerate(past.layers):
        gathered = [t.gather(2, index[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3])) * keep
                    for t in (layer.keys, layer.values)]  # fmt: skip
        cache.update(*gathered, layer_index)
    return cache, out.logits[:, -1]
