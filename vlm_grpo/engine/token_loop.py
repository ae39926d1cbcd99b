"""The decode loop's state in device buffers that outlive a generation, and the sampling step that updates it.

A decode step is a forward (`FastGenerator._decode_fn`) followed by sampling: the logits processors, one draw (or
argmax), the pad after EOS and the finished flags. Done with Python-side tensors, sampling is ~15 small kernels
launched from the host per token (1.6 ms of host time per 16-row step on an H100, against 0.27 ms of GPU time), and
the forward's inputs (positions, cache slot, mask) are fresh tensors every token. Here every tensor the loop reads or
writes lives in `DecodeBuffers`, allocated once per batch shape and refilled in place, and `Sampler.sample` writes
into them in place. Nothing in a step then depends on the host, so the whole token, forward and sampling, is recorded
as one CUDA graph (`engine.decode_graph`) when the processors are `samples_in_graph`: those that read only the
scores. `min_new_tokens` counts the new tokens from the buffers (`MinNewTokensOnDevice`) rather than from the length of
the ids, which a recorded step cannot see grow. Processors that read the generated ids themselves (repetition penalty,
n-gram bans) read a slice that grows every token: sampling then stays on the host, after the recorded forward.

The arithmetic is `generate`'s: the same processors, `torch.multinomial` over their softmax (or argmax), the pad after
EOS; the CPU tests compare tokens with `model.generate` under greedy decoding and seeded sampling.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["DecodeBuffers", "MinNewTokensOnDevice", "Sampler", "on_device", "samples_in_graph"]

# The logits processors that read only the scores (transformers' classes, matched exactly: a subclass may read more):
# temperature, top-k, top-p, min-p and suppressed tokens, and min_new_tokens counted on the device. Their tensors are
# made once, with the sampler.
SCORE_ONLY_PROCESSORS = ("TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper",
                         "SuppressTokensLogitsProcessor")  # fmt: skip


def _score_only_types() -> frozenset[type]:
    from transformers.generation import logits_process

    return frozenset(getattr(logits_process, name) for name in SCORE_ONLY_PROCESSORS) | {MinNewTokensOnDevice}


class MinNewTokensOnDevice:
    """transformers' `MinNewTokensLengthLogitsProcessor` (no EOS before `min_new_tokens` new tokens), counting the new
    tokens as the buffers' column minus the prompt width, both device tensors, instead of the ids' length."""

    def __init__(self, min_new_tokens: int, eos: torch.Tensor) -> None:
        self.min_new_tokens = min_new_tokens
        self.eos = eos
        self._buffers: DecodeBuffers | None = None  # set by `Sampler.sample` for each call

    def bind(self, buffers: DecodeBuffers) -> None:
        """Count from `buffers` in the calls that follow (`Sampler.sample` binds its buffers before each draw)."""
        self._buffers = buffers

    def settings(self) -> tuple:
        """What the processor does, by value (not which buffers it reads this call)."""
        return (self.min_new_tokens, _frozen(self.eos))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        buffers = self._buffers
        too_early = (buffers.column - buffers.prompt_width) < self.min_new_tokens  # [1]
        is_eos = torch.isin(torch.arange(scores.shape[-1], device=scores.device), self.eos)
        return torch.where(is_eos & too_early, -math.inf, scores)


def on_device(processors: Any, prompt_width: int) -> Any:
    """`processors` with transformers' min_new_tokens processor (made for prompts of `prompt_width` tokens) replaced
    by `MinNewTokensOnDevice`, in place in the list."""
    from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor

    for i, processor in enumerate(processors):
        if type(processor) is MinNewTokensLengthLogitsProcessor:
            if processor.prompt_length_to_skip != prompt_width:  # counted from elsewhere: left as transformers made it
                continue
            processors[i] = MinNewTokensOnDevice(processor.min_new_tokens, processor.eos_token_id)
    return processors


def samples_in_graph(processors: Any) -> bool:
    """Whether every processor in `processors` (a `LogitsProcessorList`) reads only the scores, so sampling can be
    recorded with the forward."""
    types = _score_only_types()
    return all(type(p) in types for p in processors)


def _frozen(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.device), str(value.dtype), tuple(value.shape), tuple(value.flatten().tolist()))
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


def _settings(processor: Any) -> tuple:
    if isinstance(processor, MinNewTokensOnDevice):
        return processor.settings()
    return tuple(sorted((k, _frozen(v)) for k, v in vars(processor).items()))


@dataclass
class Sampler:
    """One generation's sampling rules: the logits processors, sampling or argmax, EOS ids and the pad id.

    A sampler recorded into a CUDA graph must stay the same object (the graph reads its tensors), so
    `FastGenerator` keeps one and reuses it while `key` (the processors' types and settings, EOS and pad) is
    unchanged.
    """

    processors: Any
    do_sample: bool
    eos: torch.Tensor
    pad_id: int

    @functools.cached_property
    def reads_only_scores(self) -> bool:
        """Whether the sampling can be recorded with the forward (`samples_in_graph`)."""
        return samples_in_graph(self.processors)

    @property
    def key(self) -> tuple:
        """What the sampling does, by value (equal keys: the same draws from the same scores and random state)."""
        return (
            tuple((type(p).__name__, _settings(p)) for p in self.processors),
            self.do_sample,
            _frozen(self.eos),
            self.pad_id,
        )

    def sample(self, buffers: DecodeBuffers, logits: torch.Tensor, ids: torch.Tensor) -> None:
        """Draw every row's next token from `logits` [B, V] (float32) and write it into `buffers`: the next input, the
        token column, the finished flags. `ids` are the tokens so far (prompt and completion), for processors that
        read them."""
        for processor in self.processors:
            if isinstance(processor, MinNewTokensOnDevice):
                processor.bind(buffers)
        scores = self.processors(ids, logits)
        if self.do_sample:
            chosen = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        else:
            chosen = scores.argmax(dim=-1)
        # The sampler's log-prob of its pick: over the processed scores (temperature, suppressed ids, top-k/p), as
        # vLLM's "processed_logprobs" are; the trainer compares the loss's scored log-probs with it.
        logprob = scores.gather(1, chosen[:, None]).squeeze(1) - torch.logsumexp(scores, dim=-1)
        chosen = torch.where(buffers.unfinished, chosen, self.pad_id)
        buffers.next_tokens.copy_(chosen)
        buffers.tokens.index_copy_(1, buffers.column, chosen[:, None])
        buffers.logprobs.index_copy_(1, buffers.column, logprob[:, None])
        buffers.column.add_(1)
        buffers.unfinished.logical_and_(~torch.isin(chosen, self.eos))


@dataclass
class DecodeBuffers:
    """The tensors one decode step reads and writes, for a batch of `B` rows and a cache of `cache_len` slots.

    Allocated once per shape and refilled by `start` for each generation, so a recorded step keeps reading the same
    addresses. `advance` moves them one token on: the position and cache slot of the token just sampled, and its
    column of the attention mask.
    """

    next_tokens: torch.Tensor  # [B]: every row's last sampled token, the next forward's input
    position: torch.Tensor  # that token's position ids ([B, 1]; Qwen-VL's rotary positions [3, B, 1])
    slot: torch.Tensor  # [1]: the cache slot that token is written to
    mask: torch.Tensor  # [B, cache_len]: 1 for the slots written so far
    tokens: torch.Tensor  # [B, cache_len]: the prompt, then the completion
    logprobs: torch.Tensor  # [B, cache_len] float32: the sampler's log-prob of each completion token (where sampled)
    column: torch.Tensor  # [1]: where in `tokens` the next sampled token goes
    prompt_width: torch.Tensor  # [1]: the prompts' padded width, where the completion starts in `tokens`
    unfinished: torch.Tensor  # [B] bool: no EOS sampled yet

    @classmethod
    def allocate(
        cls, batch: int, cache_len: int, position_shape: tuple[int, ...], device: torch.device
    ) -> DecodeBuffers:
        """Empty buffers for `batch` rows and a cache of `cache_len` slots."""
        long = {"dtype": torch.long, "device": device}
        return cls(
            next_tokens=torch.zeros(batch, **long),
            position=torch.zeros(position_shape, **long),
            slot=torch.zeros(1, **long),
            mask=torch.zeros(batch, cache_len, **long),
            tokens=torch.zeros(batch, cache_len, **long),
            logprobs=torch.zeros(batch, cache_len, dtype=torch.float32, device=device),
            column=torch.zeros(1, **long),
            prompt_width=torch.zeros(1, **long),
            unfinished=torch.ones(batch, dtype=torch.bool, device=device),
        )

    def fits(self, batch: int, cache_len: int, position_shape: tuple[int, ...], device: torch.device) -> bool:
        """Whether these buffers serve that shape."""
        return (
            tuple(self.tokens.shape) == (batch, cache_len)
            and tuple(self.position.shape) == tuple(position_shape)
            and self.tokens.device == device
        )

    def start(self, prompts: torch.Tensor, prompt_mask: torch.Tensor, last_position: torch.Tensor, pad_id: int) -> None:
        """Refill for a generation: left-padded `prompts` [B, width] with their mask, and the position ids of their
        last token."""
        width = prompts.shape[1]
        self.tokens.fill_(pad_id)
        self.tokens[:, :width] = prompts
        self.mask.zero_()
        self.mask[:, :width] = prompt_mask
        self.position.copy_(last_position)
        self.slot.fill_(width - 1)
        self.column.fill_(width)
        self.prompt_width.fill_(width)
        self.unfinished.fill_(True)

    def advance(self) -> None:
        """Move on to the token just sampled: its position, its cache slot, its mask column."""
        self.position.add_(1)
        self.slot.add_(1)
        self.mask.index_fill_(1, self.slot, 1)
