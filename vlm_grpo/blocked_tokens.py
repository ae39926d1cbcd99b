"""The tokens the sampler can never pick, and the same exclusion in the softmax the loss scores with.

Generation suppresses some ids: TRL suppresses the image pad token (a sampled one would have no image features behind
it), the trainer adds the video pad token, and a user can add `suppress_tokens` or `bad_words_ids` in
`generation_kwargs`. The sampler's distribution is then the model's softmax over the other ids. If the loss scored
each sampled token over the *full* softmax, a blocked id would never be sampled, so never pushed down: it becomes a
probability sink (measured: its mass went 0.015 -> ~1.0 over 360 steps of a tiny model), every sampled token is
scored too low by -log(1 - p_blocked), and the logged KL explodes. This module is the one owner of "which ids are
blocked" (`blocked_ids`, read by generation's config and by scoring) and puts the same exclusion into TRL's fused LM
head (`excluded_from_scoring`): a bias of `BLOCKED_LOGIT` on those ids, so their probability is exactly 0 in the
log-probs and the entropy, the rest renormalised, for the policy and the reference, on every scoring path (TRL's
per-row forward, the shared-prefix scorer, video batches) since they all call that head.

Blocks that depend on the position (`min_new_tokens`, `begin_suppress_tokens`, `bad_words_ids` entries of several
tokens) cannot be one bias over the vocabulary: those are refused by `check_blocking_settings` with the fix named,
except `min_new_tokens`, which is allowed with a logged warning (EOS is trained at every later position, so it does
not become a sink; the gap shows in `sampling/sampling_logp_difference/*`). A `min_new_tokens` that reaches
`max_new_tokens` blocks EOS everywhere, and is scored so.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from .families import core_model
from .private_api import merged_generation_config

__all__ = [
    "BLOCKED_LOGIT",
    "blocked_ids",
    "check_blocking_settings",
    "excluded_from_scoring",
    "scoring_as_sampled",
    "suppress_token",
]

logger = logging.getLogger(__name__)

# Added to a blocked id's logit before TRL's kernel applies logit scaling, softcapping and temperature. Finite, so the
# kernel's entropy sum (p * logit) stays 0 rather than 0 * -inf = NaN, and small enough for fp16 tiles; exp(-1e4 - m)
# underflows to exactly 0 in float32 for any logit a model produces. Under final-logit softcapping (Gemma 2,
# PaliGemma 2) the capped value is -softcap, a probability below exp(-2 * softcap) ~ 1e-26 at cap 30.
BLOCKED_LOGIT = -1e4


def _single_token_bad_words(bad_words_ids: Iterable[Iterable[int]] | None) -> tuple[list[int], list[list[int]]]:
    single, longer = [], []
    for words in bad_words_ids or []:
        words = list(words)
        (single if len(words) == 1 else longer).append(words)
    return [w[0] for w in single], longer


def _eos_everywhere(generation_config: Any) -> bool:
    """`min_new_tokens` reaching `max_new_tokens`: EOS is blocked at every completion position (benchmarks force the
    completion length so)."""
    low, high = getattr(generation_config, "min_new_tokens", None), getattr(generation_config, "max_new_tokens", None)
    return bool(low) and high is not None and low >= high


def blocked_ids(generation_config: Any) -> tuple[int, ...]:
    """The ids generation never samples at any position under `generation_config`: `suppress_tokens`, the
    single-token entries of `bad_words_ids`, and EOS when `min_new_tokens` reaches `max_new_tokens`; sorted.

    >>> from transformers import GenerationConfig
    >>> blocked_ids(GenerationConfig(suppress_tokens=[7, 3], bad_words_ids=[[5], [3]]))
    (3, 5, 7)
    >>> blocked_ids(GenerationConfig(eos_token_id=[2, 9], min_new_tokens=8, max_new_tokens=8))
    (2, 9)
    """
    ids = set(getattr(generation_config, "suppress_tokens", None) or [])
    ids.update(_single_token_bad_words(getattr(generation_config, "bad_words_ids", None))[0])
    if _eos_everywhere(generation_config):
        eos = getattr(generation_config, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else eos or [])
    return tuple(sorted(int(i) for i in ids))


# Generation settings that reshape the sampler's distribution by the context (their neutral values): a logits
# processor the loss cannot apply, so said once when set.
_BY_CONTEXT = {"sequence_bias": None, "repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
               "encoder_repetition_penalty": 1.0, "encoder_no_repeat_ngram_size": 0}  # fmt: skip


def check_blocking_settings(generation_config: Any) -> None:
    """Refuse blocks the loss cannot apply (they depend on the position or on earlier tokens), naming the fix.

    Raises:
        ValueError: `bad_words_ids` with an entry of several tokens, or `begin_suppress_tokens`.
    """
    _, longer = _single_token_bad_words(getattr(generation_config, "bad_words_ids", None))
    if longer:
        raise ValueError(
            f"bad_words_ids {longer[:3]} block a token only after the tokens before it, which the loss cannot apply "
            "to its softmax: it would score the policy over tokens the sampler could not pick. Give bad_words_ids "
            "as single tokens ([[id], ...]) or use suppress_tokens."
        )
    if getattr(generation_config, "begin_suppress_tokens", None):
        raise ValueError(
            "begin_suppress_tokens blocks tokens at the first completion position only, which the loss cannot apply "
            "to its softmax. Remove it, or block the tokens everywhere with suppress_tokens."
        )
    reshaped = [f"{name}={getattr(generation_config, name)!r}"[:60] for name, neutral in _BY_CONTEXT.items()
                if getattr(generation_config, name, neutral) not in (neutral, None)]  # fmt: skip
    if reshaped:
        logger.warning(
            "%s: generation reweights tokens by the tokens before them, which the loss's softmax does not: the loss "
            "scores the policy's own distribution (as TRL does), not the one sampled from. The gap is logged as "
            "sampling/sampling_logp_difference; fast_generation_importance_sampling=True corrects for it.",
            ", ".join(reshaped),
        )
    if (getattr(generation_config, "min_new_tokens", None) or 0) > 0 and not _eos_everywhere(generation_config):
        logger.warning(
            "min_new_tokens=%d: EOS is blocked for the first completion tokens while sampling but not in the loss's "
            "softmax; the mismatch is logged as sampling/sampling_logp_difference.", generation_config.min_new_tokens
        )  # fmt: skip


def suppress_token(trainer: Any, token_id: int | None) -> None:
    """Add `token_id` to the tokens generation never samples (TRL's generation config and kwargs); scoring excludes
    it too, since it reads `blocked_ids` of the same config."""
    if token_id is None:
        return
    kwargs, config = trainer.generation_kwargs, trainer.generation_config  # TRL built the config from the kwargs
    if token_id not in (kwargs.get("suppress_tokens") or []):
        kwargs["suppress_tokens"] = [*(kwargs.get("suppress_tokens") or []), token_id]
    if token_id not in (config.suppress_tokens or []):
        config.suppress_tokens = [*(config.suppress_tokens or []), token_id]


class _HeadWithBlockedIds:
    """The LM head as TRL's fused forward reads it (`.weight`, `.bias`), with `bias` blocking some ids; built when
    read, since FSDP2 swaps the head's sharded weight for the gathered one only inside the forward."""

    def __init__(self, head: Any, ids: tuple[int, ...]) -> None:
        self._head = head
        self._ids = ids

    @property
    def weight(self) -> torch.Tensor:
        return self._head.weight

    @property
    def bias(self) -> torch.Tensor:
        return _blocking_bias(self._head, self._ids)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._head, name)


def head_rows(weight: torch.Tensor) -> int:
    """The LM head's vocabulary rows: ZeRO-3 leaves a partitioned weight empty outside a gather and keeps its whole
    shape in `ds_shape` (the 3B run's first ZeRO-3 attempt stopped at "outside the LM head's 0 rows")."""
    return int(getattr(weight, "ds_shape", weight.shape)[0])


@functools.lru_cache(maxsize=8)
def _blocked_rows(rows: int, device: torch.device, ids: tuple[int, ...]) -> torch.Tensor:
    """`BLOCKED_LOGIT` at `ids`, 0 elsewhere: made once per head size, device and ids, since writing it from a host
    list waits for the GPU to finish everything queued (twice a step: the reference and the training forward).
    Callers never write into it. Made outside inference mode, so that a first call under it does not leave a tensor
    autograd refuses to save in every training forward after."""
    with torch.inference_mode(False):
        bias = torch.zeros(rows, dtype=torch.float32, device=device)
        bias[list(ids)] = BLOCKED_LOGIT
    return bias


def _blocking_bias(head: Any, ids: tuple[int, ...]) -> torch.Tensor:
    weight = head.weight
    bias = _blocked_rows(head_rows(weight), weight.device, ids)
    own = getattr(head, "bias", None)
    if own is not None:
        own = own.full_tensor() if hasattr(own, "full_tensor") else own
        bias = own + bias.to(own.dtype)  # the head's own bias keeps its gradient
    if hasattr(weight, "device_mesh"):  # a sharded (FSDP2) head: TRL gathers its weight and bias, so ours is a DTensor
        from torch.distributed.tensor import DTensor, Replicate

        mesh = weight.device_mesh
        bias = DTensor.from_local(bias, mesh, [Replicate()] * mesh.ndim, run_check=False)
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    if is_deepspeed_zero3_enabled():  # TRL gathers the head's parameters by their ZeRO-3 status: ours is whole
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        bias.ds_status = ZeroParamStatus.AVAILABLE
    return bias


@contextlib.contextmanager
def excluded_from_scoring(model: Any, ids: tuple[int, ...]) -> Iterator[None]:
    """Within the block, TRL's fused LM head on `model` gives the blocked `ids` probability 0 (log-probs and entropy
    over the other ids, renormalised). Re-entrant; a no-op without `ids`.

    `model` is what TRL added its fused head to (`add_fused_lm_head`): the transformers model, under PEFT its base
    model. TRL's fused forward looks the head up through `get_output_embeddings()` on every call; for the block that
    call returns the head with a blocking bias (the module itself is not changed, so nothing else sees it).
    """
    if not ids or "get_output_embeddings" in vars(model):
        yield
        return
    original = model.get_output_embeddings
    head = original()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings to score blocked tokens against")
    if max(ids) >= head_rows(head.weight):
        raise ValueError(f"blocked token id {max(ids)} is outside the LM head's {head_rows(head.weight)} rows")
    proxy = _HeadWithBlockedIds(head, ids)
    model.get_output_embeddings = lambda: proxy
    try:
        yield
    finally:
        del model.get_output_embeddings


def scoring_as_sampled(trainer: Any, model: Any, unwrapped: Any = None) -> contextlib.AbstractContextManager[None]:
    """`excluded_from_scoring` for a trainer's `model` (the policy or its reference, wrapped or not): the ids its
    generation config blocks, with the model's own generation defaults filled in, as `generate` merges them.
    `unwrapped`: the model out of its wrappers, where the caller has it (unwrapping walks every module)."""
    target = core_model(unwrapped if unwrapped is not None else trainer.accelerator.unwrap_model(model))
    return excluded_from_scoring(target, blocked_ids(merged_generation_config(target, trainer.generation_config)))
