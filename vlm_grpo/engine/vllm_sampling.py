"""What vLLM samples with under `use_vllm=True`, said once for vLLM and once for the trainer's owners.

TRL builds vLLM's `SamplingParams` from its config (temperature, top-p / top-k / min-p, repetition penalty,
`max_completion_length`) and `generation_kwargs`, which it passes through as they are. Two things are ours to add:

- **Blocked ids.** A sampled image or video pad token has no features behind it: scoring then counts one image
  token more than the model has features for (TRL + vLLM's crash at 8 prompts x 8, `Image features and image tokens
  do not match`). TRL suppresses the image pad on its `generate` path only. Here the ids our generate path blocks
  (`vlm_grpo.blocked_tokens.blocked_ids`: the image and video pads, `suppress_tokens`, single-token `bad_words_ids`,
  and EOS when `min_tokens` reaches `max_tokens`) reach vLLM as `bad_words`, which vLLM sets to -inf before
  sampling, or as `allowed_token_ids` (the complement) where a token's text does not encode back to that one id. The
  loss's softmax excludes the same ids, read from the same `GenerationConfig` (`generation_config`), so the loss
  scores the distribution vLLM sampled from.
- **The same settings in either vocabulary.** A user who switches `use_vllm` on keeps `generation_kwargs` written
  for transformers' `generate`: the names with an exact vLLM equivalent are renamed (`min_new_tokens` ->
  `min_tokens`, `max_new_tokens` -> `max_tokens`, `suppress_tokens` / single-token `bad_words_ids` -> blocked ids),
  and those vLLM cannot do are refused with one line, before vLLM loads, instead of a `TypeError` from
  `SamplingParams` after it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from transformers import GenerationConfig

from ..blocked_tokens import blocked_ids, head_rows
from ..families import core_model, find_family

__all__ = ["VLLMSampling", "placeholder_ids", "vllm_sampling"]

logger = logging.getLogger(__name__)

# transformers' `generate` names with an exact SamplingParams equivalent.
_RENAMED = {"min_new_tokens": "min_tokens", "max_new_tokens": "max_tokens"}
# transformers' names vLLM has no equivalent for, and what to do instead.
_NO_EQUIVALENT = {
    "no_repeat_ngram_size": "use repetition_penalty / presence_penalty, or use_vllm=False",
    "sequence_bias": "use logit_bias (single tokens), or use_vllm=False",
    "begin_suppress_tokens": "block the tokens everywhere with suppress_tokens",
    "num_beams": "GRPO samples; beams are not rollouts",
    "do_sample": "vLLM samples whenever temperature > 0; remove it",
    "typical_p": "use top_p / min_p",
    "epsilon_cutoff": "use min_p",
    "eta_cutoff": "use min_p",
    "encoder_repetition_penalty": "use repetition_penalty",
    "encoder_no_repeat_ngram_size": "use repetition_penalty",
    "renormalize_logits": "remove it (vLLM's log-probs are normalised)",
    "cache_implementation": "remove it (vLLM manages its own cache)",
    "max_time": "bound the rollout with max_tokens (vLLM has no time limit), or use_vllm=False",
    "stop_strings": "vLLM's name for it is stop",
}
# vLLM settings that reweight tokens, which the loss's softmax does not apply (said once, as for generate's).
_REWEIGHTING = {"logit_bias": None, "presence_penalty": 0.0, "frequency_penalty": 0.0}


@dataclass(frozen=True)
class VLLMSampling:
    """vLLM's sampling for a trainer: `sampling_kwargs` (what TRL passes to `SamplingParams` beyond its own, i.e. its
    `generation_kwargs`) and `generation_config` (the same settings as transformers spells them, which the trainer's
    blocked-id owner, setting checks and scoring read)."""

    sampling_kwargs: dict[str, Any]
    generation_config: GenerationConfig

    @property
    def blocked(self) -> tuple[int, ...]:
        """The ids vLLM never samples, as scoring excludes them."""
        return blocked_ids(self.generation_config)


def placeholder_ids(model: Any) -> tuple[int, ...]:
    """The ids of `model`'s image and video placeholder tokens (sorted)."""
    config = core_model(model).config
    family = find_family(config)
    if family is not None:
        return tuple(sorted(family.image_token_ids(config)))
    values = (getattr(config, name, None) for name in ("image_token_id", "image_token_index", "video_token_id"))
    return tuple(sorted({v for v in values if isinstance(v, int)}))


def _vllm_bad_word_ids(words: list[str], tokenizer: Any) -> list[list[int]]:
    """The token sequences vLLM blocks for `bad_words` (`SamplingParams.update_from_tokenizer`): each word without
    and, where that is a different word token of the same length, with a leading space."""
    sequences: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        sequences.append(plain)
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    return sequences


def _blocking_kwargs(blocked: set[int], tokenizer: Any, vocab_size: int) -> tuple[dict, set[int]]:
    """`SamplingParams` settings that block exactly `blocked`, and the ids they block: `bad_words` where vLLM's reading
    of each id's text is that id alone, else `allowed_token_ids` (the complement)."""
    texts = [tokenizer.decode([i]) for i in sorted(blocked)]
    sequences = _vllm_bad_word_ids(texts, tokenizer)
    if all(len(s) == 1 for s in sequences) and {s[0] for s in sequences} == blocked:
        return ({"bad_words": texts} if blocked else {}), blocked
    # The complement, over the ids vLLM accepts there (the tokenizer's); the head's rows past them are never sampled.
    allowed = [i for i in range(len(tokenizer)) if i not in blocked]
    logger.info("vLLM blocks %d ids through allowed_token_ids: %d of them do not encode back from their text alone.",
                len(blocked), sum(len(s) != 1 for s in sequences))  # fmt: skip
    return {"allowed_token_ids": allowed}, blocked | set(range(len(tokenizer), vocab_size))


def vllm_sampling(args: Any, model: Any, processing_class: Any) -> VLLMSampling:
    """What vLLM will sample with for a trainer of `args` on `model`, or a `ValueError` naming the setting vLLM
    cannot apply and the fix."""
    kwargs = dict(args.generation_kwargs or {})
    for name, fix in _NO_EQUIVALENT.items():
        if name in kwargs:
            raise ValueError(f"generation_kwargs[{name!r}] has no vLLM equivalent (use_vllm=True): {fix}.")
    for old, new in _RENAMED.items():
        if old in kwargs:
            if new in kwargs:
                raise ValueError(f"generation_kwargs sets both {old!r} (transformers) and {new!r} (vLLM); keep one.")
            kwargs[new] = kwargs.pop(old)
    blocked = set(placeholder_ids(model)) | {int(i) for i in kwargs.pop("suppress_tokens", None) or []}
    for words in kwargs.pop("bad_words_ids", None) or []:
        if len(words) != 1:
            raise ValueError(f"bad_words_ids entry {list(words)} blocks a token only after the tokens before it, which "
                             "the loss cannot apply to its softmax. Give single tokens ([[id], ...]).")  # fmt: skip
        blocked.add(int(words[0]))
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    for word in kwargs.pop("bad_words", None) or []:
        sequences = _vllm_bad_word_ids([word], tokenizer)  # as vLLM reads it: the word, and with a leading space
        if any(len(sequence) != 1 for sequence in sequences):
            raise ValueError(f"bad_words entry {word!r} is several tokens: vLLM blocks its last token only after the "
                             "others, which the loss cannot apply to its softmax. Give single-token words.")  # fmt: skip
        blocked.update(sequence[0] for sequence in sequences)
    vocab_size = head_rows(core_model(model).get_output_embeddings().weight)  # ZeRO-3: the whole head's rows
    if (allowed := kwargs.pop("allowed_token_ids", None)) is not None:  # the head's rows past the tokenizer too
        blocked |= set(range(vocab_size)) - {int(i) for i in allowed}
    reweighting = [
        f"{k}={kwargs[k]!r}"[:60] for k, neutral in _REWEIGHTING.items() if kwargs.get(k) not in (neutral, None)
    ]
    if reweighting:
        logger.warning("%s: vLLM reweights tokens, which the loss's softmax does not; the gap is logged as "
                       "sampling/sampling_logp_difference.", ", ".join(reweighting))  # fmt: skip
    blocking, blocked = _blocking_kwargs(blocked, tokenizer, vocab_size)
    config = GenerationConfig(
        do_sample=True, max_new_tokens=kwargs.get("max_tokens", args.max_completion_length),
        min_new_tokens=kwargs.get("min_tokens"), temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k or None, min_p=args.min_p, repetition_penalty=kwargs.get("repetition_penalty", args.repetition_penalty),
        suppress_tokens=sorted(blocked) or None,
    )  # fmt: skip
    own_eos = getattr(getattr(core_model(model), "generation_config", None), "eos_token_id", None)
    config.eos_token_id = own_eos if own_eos is not None else tokenizer.eos_token_id
    return VLLMSampling(sampling_kwargs={**kwargs, **blocking}, generation_config=config)
