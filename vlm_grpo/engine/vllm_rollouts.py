"""Rollouts through vLLM (`use_vllm=True`): TRL's `VLLMGeneration`, given the prompts vLLM expects and checked.

TRL hands vLLM each prompt's token ids as the trainer's processor expanded them (a 448² image is 256
`<|image_pad|>` tokens on Qwen2.5-VL) together with the images. vLLM 0.26 processes the images itself and expands
each placeholder it finds again: measured on one H100 (Qwen2.5-VL-3B architecture, `benchmarks/vllm_gap.py`), the
prompt vLLM generated from held 531 tokens where the trainer's held 276, 256 image pads with features behind them and
255 more without. Every completion was sampled from another prompt than the loss scores: 0.97 nats per token apart
(text-only prompts: 0.027, bf16 rounding), and TRL's default importance-sampling mask (`sequence_mask`, a sequence's
ratio within [0, 3]) then zeroes whole sequences, so the loss was 0.0 at every step.

Here (`CheckedVLLMGeneration.generate`):
- in colocate mode, each run of image or video placeholders goes to vLLM as one placeholder, the form vLLM expands
  from its own processing of the image (server mode sends the features with their positions in the trainer's ids,
  which TRL already places);
- vLLM's expanded prompt is checked against the trainer's, token for token. A difference (the processor vLLM loaded
  from disk resizing otherwise, a family whose placeholders vLLM expands differently) stops the run with one line
  naming the row and both lengths: sampling from a prompt the loss does not score is the silent failure this guards.

After each weight sync vLLM's cache of vision-encoder outputs is emptied (`CheckedVLLMGeneration.sync_weights`). TRL
resets vLLM's prefix cache there, not this one, and vLLM keeps an image's encoder output to reuse for the same image
later: an image seen again after the vision LoRA moved was given features of the old weights. Measured on the H100
(Qwen2.5-VL-3B, LoRA incl. vision, learning rate 1e-3, 4 images over 3 steps): the sampler gap went 0.030, 0.064,
0.557 nats per token, the third step's images having been seen in the first. Server mode cannot reach the server's
cache: said once (`attach_vllm`).

The weights vLLM receives each step (TRL's `sync_weights`): for a LoRA model on one device, each adapted weight is
merged out of place, `W + scaling * B @ A` into a new tensor per layer (`merged_weights`), where TRL merges the
adapters into the base weights and unmerges them after. In bf16 that round trip does not give the base weights back
(the frozen weights and the KL reference move a little at every step; a test shows it). Under FSDP2 each weight is
gathered from its shards (`full_tensor()`) and merged the same way, where TRL merges into sharded weights; FSDP1,
ZeRO-3 and quantised models keep TRL's way.

`engine_settings` gives TRL's `LLM(...)` the trainer's pixel budget (`mm_processor_kwargs`), so vLLM's processor
sizes images as the trainer's does even where the budget differs from the processor saved with the checkpoint.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Collection, Iterator, Sequence
from typing import Any

import torch
from trl.generation.vllm_generation import VLLMGeneration

from ..media.pixel_budget import processor_pixel_budget
from ..models.sharded import whole
from .fused_projections import merges_as_a_delta
from .vllm_sampling import VLLMSampling, placeholder_ids

logger = logging.getLogger(__name__)

__all__ = [
    "CheckedVLLMGeneration", "attach_vllm", "check_expansion", "collapse_placeholders", "engine_settings",
    "merged_weights",
]  # fmt: skip


def collapse_placeholders(ids: Sequence[int], placeholders: Collection[int]) -> list[int]:
    """`ids` with every run of one placeholder token shortened to a single token.

    >>> collapse_placeholders([1, 9, 9, 9, 2, 9, 8, 8, 3], {8, 9})
    [1, 9, 2, 9, 8, 3]
    """
    out: list[int] = []
    for token in ids:
        if not (out and token == out[-1] and token in placeholders):
            out.append(int(token))
    return out


def check_expansion(
    ours: Sequence[Sequence[int]], vllms: Sequence[Sequence[int]], placeholders: Collection[int]
) -> None:
    """Raise `ValueError` unless vLLM's prompt ids (`vllms`, placeholders expanded by vLLM's processor) are the
    trainer's (`ours`), row by row."""
    if len(ours) != len(vllms):
        raise ValueError(f"vLLM returned {len(vllms)} prompts for {len(ours)}.")
    for row, (mine, theirs) in enumerate(zip(ours, vllms)):
        if list(mine) != list(theirs):
            count = lambda ids: sum(t in placeholders for t in ids)
            raise ValueError(
                f"vLLM generated row {row} from a prompt of {len(theirs)} tokens ({count(theirs)} image / video "
                f"placeholders) where the trainer scores {len(mine)} ({count(mine)}): its processor sizes the media "
                "otherwise, so the completions would be sampled from another prompt than the loss scores. Save the "
                "trainer's processor beside the checkpoint vLLM loads (processor.save_pretrained), or use_vllm=False."
            )


class CheckedVLLMGeneration(VLLMGeneration):
    """TRL's `VLLMGeneration` whose `generate` sends vLLM its own placeholder form and checks vLLM's expansion
    against the trainer's prompt ids (set by `attach_vllm`, which gives a trainer's generation this class)."""

    placeholders: tuple[int, ...] = ()

    def generate(self, prompts: list[list[int]], images: Any, num_generations: int, profiler: Any = None) -> tuple:
        """TRL's `generate`, each prompt's placeholder runs collapsed for vLLM (colocate mode) and its expanded
        prompts checked against `prompts`; returns the trainer's prompt ids with vLLM's completions."""
        sent = prompts
        if self.mode == "colocate" and images is not None:
            sent = [collapse_placeholders(ids, self.placeholders) if row_images else ids
                    for ids, row_images in zip(prompts, images, strict=True)]  # fmt: skip
        prompt_ids, completion_ids, logprobs, logprob_token_ids = super().generate(
            prompts=sent, images=images, num_generations=num_generations, profiler=profiler
        )
        check_expansion(prompts, prompt_ids, self.placeholders)
        return [list(ids) for ids in prompts], completion_ids, logprobs, logprob_token_ids

    def sync_weights(self) -> None:
        """TRL's sync, then vLLM's encoder cache emptied (colocate mode): no vision features of the old weights."""
        super().sync_weights()
        if self.mode == "colocate":
            self.llm.llm_engine.reset_encoder_cache()

    def _iter_named_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        # A LoRA model's merged weights out of place, on one device or gathered from FSDP2's shards; FSDP1 and
        # ZeRO-3 models are gathered TRL's way.
        fsdp1 = self._dist.is_fsdp and self._dist.fsdp_version != 2
        exact = None if fsdp1 or _is_zero3() else merged_weights(self.model)
        yield from (exact if exact is not None else super()._iter_named_params())


def _is_zero3() -> bool:
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    return is_deepspeed_zero3_enabled()


def merged_weights(model: Any) -> Iterator[tuple[str, torch.Tensor]] | None:
    """Every weight of PEFT `model` under the name transformers gives it without PEFT, each LoRA-adapted one merged
    out of place (`W + scaling * B @ A` in a new tensor; the base weight untouched), one at a time; FSDP2 shards are
    gathered one weight at a time (every rank iterates: a collective). None where that is not exact (no adapters,
    DoRA or another variant, a quantised or non-Linear base): TRL's merge then serves."""
    layers = [m for m in model.modules() if hasattr(m, "lora_A") and hasattr(m, "get_base_layer")]
    if not layers or not hasattr(model, "prefix") or not all(merges_as_a_delta(layer) for layer in layers):
        return None
    owners = {id(layer.get_base_layer().weight): layer for layer in layers}

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if model.prefix in name or "original_module" in name:  # the adapters themselves; a saved module's copy
                    continue
                name = name.removeprefix("base_model.model.").replace(".base_layer", "")
                name = name.replace("modules_to_save.default.", "").replace("_checkpoint_wrapped_module.", "")
                sharded = hasattr(param, "full_tensor")  # FSDP2: gathered (a collective), a new tensor already
                value, layer = (whole(param) if sharded else param.data), owners.get(id(param))
                if layer is not None and not layer.disable_adapters:
                    value = value if sharded else value.clone()
                    for adapter in (a for a in layer.active_adapters if a in layer.lora_A):
                        lora_a, lora_b = whole(layer.lora_A[adapter].weight), whole(layer.lora_B[adapter].weight)
                        value.addmm_(lora_b.to(value.dtype), lora_a.to(value.dtype), alpha=layer.scaling[adapter])
                yield name, value

    return weights()


def attach_vllm(trainer: Any, sampling: VLLMSampling) -> None:
    """After TRL built `trainer.vllm_generation`: its class checked (`CheckedVLLMGeneration`), `sampling`'s settings
    as its `SamplingParams` extras, and `trainer.generation_config` the same settings as transformers spells them
    (TRL sets none under vLLM; the blocked-id owner and scoring read it)."""
    generation = trainer.vllm_generation
    if generation.mode == "colocate" and not hasattr(generation.llm.llm_engine, "reset_encoder_cache"):
        raise ImportError("This vLLM cannot empty its encoder cache after a weight sync, so repeated images would get "
                          "features of old weights: upgrade vLLM (0.26 has it).")  # fmt: skip
    if generation.mode == "server":
        logger.warning("vLLM server mode: the server keeps vision-encoder outputs across weight syncs, so an image "
                       "seen again may get features of older weights (colocate mode empties that cache).")  # fmt: skip
    generation.__class__ = CheckedVLLMGeneration
    generation.placeholders = placeholder_ids(trainer.accelerator.unwrap_model(trainer.model))
    generation.generation_kwargs = dict(sampling.sampling_kwargs)
    trainer.generation_config = sampling.generation_config


@contextlib.contextmanager
def engine_settings(processing_class: Any) -> Iterator[None]:
    """While TRL builds its colocated `LLM`: the trainer's pixel budget as vLLM's `mm_processor_kwargs`, so vLLM's
    processor resizes images as the trainer's does (a no-op for processors without a pixel budget)."""
    import trl.generation.vllm_generation as trl_vllm

    budget = processor_pixel_budget(processing_class)
    original = getattr(trl_vllm, "LLM", None)
    if budget is None or original is None:  # no budget to pass, or no vLLM (TRL then says how to install it)
        yield
        return
    trl_vllm.LLM = functools.partial(original, mm_processor_kwargs={"min_pixels": budget[0], "max_pixels": budget[1]})
    try:
        yield
    finally:
        trl_vllm.LLM = original
