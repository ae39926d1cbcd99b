"""The sampler's log-probs beside the loss's: their gap logged every step, TRL's importance sampling on request.

The fast generator returns the log-prob with which it sampled each token, over the processed scores (temperature,
blocked ids, top-k / top-p), as vLLM's "processed_logprobs" are. With the blocked ids out of the loss's softmax too
(`vlm_grpo.blocked_tokens`), what remains between the two is rounding (bf16 weights with LoRA merged, compiled
kernels) and truncation (top-k / top-p, which the loss does not apply). Both are logged under TRL's names for the
vLLM gap, `sampling/sampling_logp_difference/mean` and `/max` (|scored - sampled| over the completion tokens that
enter the loss), measured on the policy that sampled: the loss's own log-probs of a batch's first use, or TRL's
`old_per_token_logps` where it computes them.

Importance sampling: TRL's vLLM correction (`vllm_importance_sampling_correction`, `vllm_importance_sampling_mode`,
`vllm_importance_sampling_clip_min` / `_clip_max`) reweights each token's (or sequence's) loss by the scorer/sampler
ratio, truncated or masked. TRL applies it only when `use_vllm` is set. With `fast_generation_importance_sampling=True`
the same TRL code runs on the fast path's rollouts: the trainer reads as using vLLM from the end of the fast
generation to the end of scoring (`sampled_as_vllm`), and in the loss of a batch that carries TRL's ratio
(`loss_as_vllm`). It costs one more forward of the policy per generation batch (TRL scores the rollouts before
training on them), which is why it is off by default: the gap it corrects is logged either way.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "GAP_METRICS",
    "MASKED_METRIC",
    "log_batch_gap",
    "log_logp_gap",
    "log_masked_sequences",
    "loss_as_vllm",
    "mark_sampled",
    "plain_turn_logprobs",
    "sampled_as_vllm",
]  # fmt: skip

logger = logging.getLogger(__name__)

GAP_METRICS = ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max")
MASKED_METRIC = "sampling/importance_sampling_masked"  # fraction of the batch's ratios TRL's mask set to 0


def log_masked_sequences(trainer: Any, output: dict[str, Any]) -> None:
    """The fraction of a scored batch that TRL's importance-sampling mask (`*_mask` modes) zeroed, logged; a batch
    zeroed whole trains on nothing, which is said (once per run) with the gap that caused it and the settings."""
    ratio = output.get("importance_sampling_ratio")
    if ratio is None or "mask" not in str(getattr(trainer.args, "vllm_importance_sampling_mode", "")):
        return
    masked = trainer.accelerator.gather((ratio == 0).float().mean()).mean().item()
    trainer._metrics["train" if trainer.model.training else "eval"][MASKED_METRIC].append(masked)
    if masked == 1.0 and not getattr(trainer, "_warned_all_masked", False):
        trainer._warned_all_masked = True
        logger.warning(
            "Importance sampling masked every sequence of a batch (vllm_importance_sampling_mode=%r, clip %s-%s): "
            "the sampler's and the loss's log-probs are too far apart (sampling/sampling_logp_difference), so this "
            "step trains on nothing. Find why they differ, or use a *_truncate mode.",
            trainer.args.vllm_importance_sampling_mode, trainer.args.vllm_importance_sampling_clip_min,
            trainer.args.vllm_importance_sampling_clip_max,
        )  # fmt: skip


def log_logp_gap(trainer: Any, scored: torch.Tensor, sampled: torch.Tensor, mask: torch.Tensor) -> None:
    """Record |scored - sampled| over the tokens of `mask` in `trainer`'s metrics (mean and max over every process),
    as TRL records the vLLM gap; tokens the sampler gave no log-prob (NaN) are left out."""
    delta = (scored.detach().float() - sampled.float()).abs()
    delta = delta[mask.bool() & ~torch.isnan(delta)]
    zero = torch.zeros((), device=delta.device)
    mean = delta.mean() if delta.numel() else zero
    largest = delta.max() if delta.numel() else zero
    metrics = trainer._metrics["train" if trainer.model.training else "eval"]
    metrics[GAP_METRICS[0]].append(trainer.accelerator.gather(mean).mean().item())
    metrics[GAP_METRICS[1]].append(trainer.accelerator.gather(largest).max().item())


def log_batch_gap(trainer: Any, inputs: dict[str, Any], scored: torch.Tensor | None) -> None:
    """Log the gap for a batch the loss just scored (`scored`: the policy's log-probs), when the batch carries the
    sampler's log-probs and TRL did not log it already (it does when it corrects for it): measured on the policy that
    sampled, the batch's first use, or TRL's old log-probs where it computed them."""
    if scored is None or "sampling_per_token_logps" not in inputs or "importance_sampling_ratio" in inputs:
        return
    mask = inputs["completion_mask"] * inputs["tool_mask"] if "tool_mask" in inputs else inputs["completion_mask"]
    log_logp_gap(trainer, inputs.get("old_per_token_logps", scored), inputs["sampling_per_token_logps"], mask)


def _correcting(trainer: Any) -> bool:
    return bool(getattr(trainer.args, "fast_generation_importance_sampling", False)) and not trainer.args.use_vllm


@contextlib.contextmanager
def sampled_as_vllm(trainer: Any) -> Iterator[None]:
    """A generation-and-scoring call: within it, once the fast path has sampled (`mark_sampled`), the trainer reads as
    using vLLM, so TRL scores the rollouts and computes its importance-sampling ratio against the sampler's log-probs.
    Restored on leaving."""
    try:
        yield
    finally:
        trainer.use_vllm = trainer.args.use_vllm


def mark_sampled(trainer: Any, logprobs: Any) -> None:
    """The fast path returned the sampler's `logprobs`: from here to the end of `sampled_as_vllm`, TRL's vLLM
    importance sampling runs on them when `fast_generation_importance_sampling` asks for it."""
    if logprobs is None or not _correcting(trainer):
        return
    if any(math.isnan(p) for row in logprobs for p in row):  # a tool turn TRL's path generated (`plain_turn_logprobs`)
        if not getattr(trainer, "_warned_partial_logprobs", False):
            trainer._warned_partial_logprobs = True
            logger.warning("A rollout had turns generated on TRL's path, which gives no sampler log-probs: no "
                           "importance sampling for such rollouts (fast_generation_importance_sampling).")  # fmt: skip
        return
    trainer.use_vllm = True


def plain_turn_logprobs(trainer: Any, completion_ids: list[list[int]], logprobs: Any) -> Any:
    """The sampler log-probs of a turn TRL's plain path generated (it gives None). Within a rollout an earlier turn
    of which the fast path generated, TRL's tool loop appends this turn's to that turn's: NaN for each token (no
    log-prob: left out of the gap; such a rollout gets no importance sampling, `mark_sampled`)."""
    if logprobs is None and getattr(trainer, "_rollout_has_logprobs", False):
        return [[math.nan] * len(ids) for ids in completion_ids]
    return logprobs


@contextlib.contextmanager
def loss_as_vllm(trainer: Any, inputs: dict[str, Any]) -> Iterator[None]:
    """The loss of a batch: TRL multiplies it by the batch's importance-sampling ratio when it reads as using vLLM."""
    if "importance_sampling_ratio" not in inputs or trainer.args.use_vllm:
        yield
        return
    trainer.use_vllm = True
    try:
        yield
    finally:
        trainer.use_vllm = trainer.args.use_vllm
