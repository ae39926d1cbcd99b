"""Which path scores a trainer's batch (old-policy, reference and policy log-probs): shared prefix, or TRL's per row.

Shared-prefix scoring computes each group's prompt and images once: packed behind one copy of the prompt
(`vlm_grpo.engine.shared_prefix`), or, for models with recurrent layers, continued from the prompt's cache
(`vlm_grpo.engine.prefix_cache`). What neither can serve falls back to TRL's per-row forward, the reason logged once (`trainer.shared_prefix_fallbacks` counts them). A
batch with clips carries each row's vision inputs beside TRL's (`media.processing.VISION_ROWS`): both paths take them
from there, TRL's by calling the model with the clips added (TRL's own forward passes only image inputs). Every path
scores through TRL's fused LM head; the caller keeps the sampler's blocked ids out of its softmax
(`vlm_grpo.blocked_tokens`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ..engine.prefix_cache import prefix_cache_logps
from ..engine.prefix_cache import serves as prefix_cache_serves
from ..engine.shared_prefix import SharedPrefixUnsupported, shared_prefix_logps
from ..families import find_family
from ..media.batch_layout import VIDEO_KEYS, select_rows
from ..media.forward_inputs import images_per_row_input, scoring_inputs
from ..media.processing import row_vision_inputs
from .unwrapped import unwrap_once

__all__ = ["logps_by_path"]

logger = logging.getLogger(__name__)

# TRL's `_get_per_token_logps_and_entropies` bound to the trainer: (model, input_ids, attention_mask, logits_to_keep,
# **kwargs) -> (logps, entropies, aux_loss).
TrlScoring = Callable[..., tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]


class _WithInputs:
    """`model` called with extra keyword inputs: a batch's clips, which TRL's per-row forward does not pass."""

    def __init__(self, model: Any, inputs: dict[str, Any]) -> None:
        self.model, self.inputs = model, inputs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs, **self.inputs)


def logps_by_path(
    trainer: Any, trl_scoring: TrlScoring, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
    logits_to_keep: int, batch_size: int | None, compute_entropy: bool, compute_aux_loss: bool,
    model_inputs: dict[str, Any],
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """TRL's `(logps, entropies, aux_loss)` for `model` on the batch, by the shared-prefix path where it serves, else
    `trl_scoring` (TRL's own method), with a batch's clips (`trainer._vision_rows`) passed to the model, and the
    processor's outputs as the family's forward takes them (`vlm_grpo.media.forward_inputs`)."""
    unwrapped = unwrap_once(trainer, model)  # DDP / FSDP wrappers off: the model's own config
    family = find_family(unwrapped)
    model_inputs = scoring_inputs(family, model_inputs, logits_to_keep)
    rows = trainer._vision_rows
    if rows is not None:  # a batch with clips: its vision inputs (images too) come from the rows, not from TRL
        if len(rows) != input_ids.size(0):
            raise RuntimeError(f"{len(rows)} rows of vision inputs for a batch of {input_ids.size(0)} rows")
        vision = row_vision_inputs(rows, input_ids, logits_to_keep, trainer.processing_class)
        model_inputs = {**model_inputs, **vision}
    if getattr(trainer.args, "shared_prefix", False):
        try:
            # Recurrent layers cannot be packed behind a shared prompt: theirs is continued from a cache.
            shared = prefix_cache_logps if prefix_cache_serves(unwrapped) else shared_prefix_logps
            with trainer.accelerator.autocast():
                logps, entropies = shared(
                    model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                    compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss,
                    unwrapped_model=unwrapped, **model_inputs,
                )  # fmt: skip
            trainer.shared_prefix_calls += 1
            return logps, entropies, None
        except SharedPrefixUnsupported as error:
            fallbacks = trainer.__dict__.setdefault("shared_prefix_fallbacks", {})
            if str(error) not in fallbacks:
                logger.warning("Shared-prefix scoring off for this call, using TRL's per-row forward: %s", error)
            fallbacks[str(error)] = fallbacks.get(str(error), 0) + 1
    if rows is not None:
        return _per_row_with_clips(trainer, trl_scoring, model, input_ids, attention_mask, logits_to_keep, batch_size,
                                   compute_entropy, compute_aux_loss)  # fmt: skip
    if family is not None and family.images_per_row_input is not None and model_inputs.get("num_images") is not None:
        return _per_forward(trainer, trl_scoring, model, input_ids, attention_mask, logits_to_keep, batch_size,
                            compute_entropy, compute_aux_loss, model_inputs, family)  # fmt: skip
    return trl_scoring(
        model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size, compute_entropy=compute_entropy,
        compute_aux_loss=compute_aux_loss, **model_inputs,
    )  # fmt: skip


def _per_forward(
    trainer: Any, trl_scoring: TrlScoring, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
    logits_to_keep: int, batch_size: int | None, compute_entropy: bool, compute_aux_loss: bool,
    model_inputs: dict[str, Any], family: Any,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """TRL's per-row forward, its method called on each `batch_size` rows with their inputs, and the input that holds
    one forward's image counts (LLaVA-OneVision's `batch_num_images`, which TRL's method does not take) handed to the
    model beside them."""
    size = input_ids.size(0)
    inputs = {k: v for k, v in model_inputs.items() if v is not None}
    num_images = [int(n) for n in inputs["num_images"]]
    results = []
    for start in range(0, size, batch_size or size):
        end = min(start + (batch_size or size), size)
        chunk = select_rows(inputs, num_images, list(range(start, end)))
        chunk["num_images"] = num_images[start:end]
        extra = images_per_row_input(family, chunk["num_images"], input_ids.device)
        results.append(trl_scoring(
            _WithInputs(model, extra), input_ids[start:end], attention_mask[start:end], logits_to_keep,
            compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **chunk,
        ))  # fmt: skip
    return _joined(results, compute_entropy, compute_aux_loss)


def _joined(
    results: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]], compute_entropy: bool,
    compute_aux_loss: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    logps = torch.cat([r[0] for r in results])
    entropies = torch.cat([r[1] for r in results]) if compute_entropy else None
    aux = torch.stack([r[2] for r in results]).mean() if compute_aux_loss else None
    return logps, entropies, aux


def _per_row_with_clips(
    trainer: Any, trl_scoring: TrlScoring, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
    logits_to_keep: int, batch_size: int | None, compute_entropy: bool, compute_aux_loss: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """TRL's per-row forward for a batch with clips: TRL's own method on each `batch_size` rows, its image inputs
    passed by name and its clips handed to the model beside them (`_WithInputs`)."""
    rows, size = trainer._vision_rows, input_ids.size(0)
    results = []
    for start in range(0, size, batch_size or size):
        end = min(start + (batch_size or size), size)
        inputs = row_vision_inputs(rows[start:end], input_ids[start:end], logits_to_keep, trainer.processing_class)
        clips = {k: inputs.pop(k) for k in VIDEO_KEYS if k in inputs}
        inputs.pop("num_videos")
        if "pixel_values" not in inputs:
            inputs.pop("num_images")
        result = trl_scoring(
            _WithInputs(model, clips), input_ids[start:end], attention_mask[start:end], logits_to_keep,
            compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **inputs,
        )  # fmt: skip
        results.append(result)
    return _joined(results, compute_entropy, compute_aux_loss)
