"""Which path generates a trainer's rollouts: the fast generator, or TRL's own `_generate_single_turn`.

The fast generator (`vlm_grpo.engine.fast_generation`) serves in-process generation on one GPU, under DDP, FSDP2 and
ZeRO-3 (weights gathered once per rollout), and every turn of a tool-calling rollout: TRL's tool loop calls the
trainer's `_generate_single_turn` again with each row's conversation so far (prompt, completion, tool results and
their images), which the fast generator completes as any prompt. TRL's path serves vLLM, transformers' continuous
batching, FSDP1, ZeRO-3 without gathering, and anything the generator itself cannot serve (`FastPathUnavailable`);
each reason is logged once per run (`trainer._fast_generation_fallbacks`).
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from typing import Any

import torch
from trl.models.utils import unwrap_model_for_generation

from ..engine.fast_generation import FastGenerator, FastPathUnavailable
from ..engine.generation_copy import copy_unfit_reason
from ..models.modes import checkpointing_off
from ..models.sharded import full_weights, sharding
from ..models.sharded import unsupported_reason as sharded_unsupported_reason
from .unwrapped import unwrap_once

__all__ = [
    "compile_setting",
    "fast_generate",
    "generation_blocker",
    "is_zero3",
    "make_generator",
    "prepare_generation_copy",
    "tool_image_token_types",
    "uses_generation_copy",
]

logger = logging.getLogger(__name__)


def is_zero3(trainer: Any) -> bool:
    """Whether `trainer` runs under DeepSpeed ZeRO-3 (weights sharded, gathered by TRL for generation)."""
    plugin = trainer.accelerator.state.deepspeed_plugin if trainer.is_deepspeed_enabled else None
    return plugin is not None and plugin.zero_stage == 3


def compile_setting(args: Any, sharded: bool) -> bool | None:
    """`fast_generation_compile`, with None resolved to off for sharded models: their weights are gathered into fresh
    memory for every generation, so a CUDA graph recorded on one step's addresses would be recorded again at every
    step, and eager decoding is faster there."""
    compile = getattr(args, "fast_generation_compile", None)
    return False if compile is None and sharded else compile


def uses_generation_copy(trainer: Any) -> bool:
    """Whether `trainer` generates from an unsharded copy of its FSDP2 model (`engine.generation_copy`)."""
    plugin = trainer.accelerator.state.fsdp_plugin if trainer.is_fsdp_enabled else None
    return (
        plugin is not None and getattr(plugin, "fsdp_version", 1) == 2
        and getattr(trainer.args, "fsdp_generation_copy", False) and getattr(trainer.args, "fast_generation", False)
        and not trainer.args.use_vllm
        and getattr(getattr(trainer, "generation_copy", None), "declined", None) is None
    )  # fmt: skip


def prepare_generation_copy(trainer: Any) -> None:
    """Make `trainer`'s generation copy of its model, not yet sharded (FSDP2 shards it when training starts), in the
    dtype its forward computes in; a model already sharded (a second `train` call) keeps gathering instead."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    if sharding(model) is not None:
        logger.warning("The model is already sharded: the fast generator gathers the shards for each rollout "
                       "(fsdp_generation_copy needs a model not yet sharded).")  # fmt: skip
        return
    args = trainer.args
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
    copy, device = trainer.generation_copy, trainer.accelerator.device
    reason = None
    if device.type == "cuda":  # the copy must leave the GPU room to train: every rank decides alike (a collective)
        reason = copy_unfit_reason(copy.own_bytes(model, device, dtype), torch.cuda.mem_get_info(device)[0])
        if _on_any_rank(reason is not None, device):
            reason = reason or "the generation copy does not fit on another rank's GPU"
    if reason is not None:
        copy.declined = reason
        logger.warning("Under FSDP2 %s.", reason)
        trainer.fast_generator = make_generator(trainer)  # for gathered weights: decoding eagerly
        return
    copy.prepare(model, device, dtype)
    if copy.shares_weights:  # the frozen base the copy shares stays whole on every rank: FSDP2 must not shard it
        plugin = trainer.accelerator.state.fsdp_plugin
        ignored = plugin.ignored_modules or []
        if isinstance(ignored, str):  # accelerate's regex form (FSDP_IGNORED_MODULES), over the module names
            pattern = re.compile(ignored)
            ignored = [module for name, module in model.named_modules() if pattern.fullmatch(name)]
        plugin.ignored_modules = [*ignored, *copy.shared_modules(model)]


def _on_any_rank(flag: bool, device: torch.device) -> bool:
    """`flag` or-ed over every rank (a collective; `flag` itself outside a process group)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    value = torch.tensor([int(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def _has_tools(trainer: Any) -> bool:
    """Whether `trainer` rolls out through TRL's tool loop (tools, or an environment's)."""
    return bool(getattr(trainer, "tools", None) or getattr(trainer, "environment_factories", None))


def make_generator(trainer: Any) -> FastGenerator:
    """The fast generator `trainer`'s config asks for."""
    args = trainer.args
    gathered = (trainer.is_fsdp_enabled and not uses_generation_copy(trainer)) or is_zero3(trainer)
    return FastGenerator(
        compile=compile_setting(args, sharded=gathered),
        merge_lora=getattr(args, "fast_generation_merge_lora", True),
        merge_backup=getattr(args, "fast_generation_merge_backup", "auto"),
        quantized=getattr(args, "fast_generation_quantized", "auto"),
        keep_decode_memory=getattr(args, "fast_generation_keep_decode_memory", True),
        # Only tool loops have later turns to continue; never where weights are gathered afresh for each call (no
        # way to tell they are the same).
        append_turns=_has_tools(trainer) and not gathered,
        turn_headroom=args.max_completion_length if _has_tools(trainer) else 0,  # later turns fit the first's cache
    )


def generation_blocker(trainer: Any) -> str | None:
    """Why `trainer` generates on TRL's plain path (None: the fast path can serve it)."""
    # TRL's attributes read plainly (vlm_grpo.private_api.TRAINER_ATTRIBUTES, checked against TRL by a test).
    if trainer.use_vllm or trainer.use_transformers_continuous_batching:
        return "generation runs in vLLM / transformers continuous batching"
    if trainer.is_fsdp_enabled and (reason := sharded_unsupported_reason(trainer.model_wrapped)):
        return reason
    if is_zero3(trainer) and not trainer.args.ds3_gather_for_generation:
        return "ds3_gather_for_generation=False: ZeRO-3 weights stay sharded while generating"
    return trainer.fast_generator.unsupported_reason(unwrap_once(trainer, trainer.model))


def tool_image_token_types(trainer: Any, prompt_ids: Any, multimodal_fields: dict[str, Any]) -> dict[str, Any]:
    """A tool turn's inputs with its image (1) and video (2) tokens marked, as TRL's plain path marks them for
    `generate` (the image processor it ran on the tool images gives no such marks): `mm_token_type_ids` for the
    families with `image_grid_thw` (Qwen's 3-D positions read them), `token_type_ids` for the others."""
    if "mm_token_type_ids" in multimodal_fields or "token_type_ids" in multimodal_fields:
        return multimodal_fields
    image, video = trainer._image_pad_token_id, trainer._video_pad_token_id
    marks = [[1 if t == image else 2 if t == video else 0 for t in ids] for ids in prompt_ids]
    key = "mm_token_type_ids" if "image_grid_thw" in multimodal_fields else "token_type_ids"
    return {**multimodal_fields, key: marks}


@contextlib.contextmanager
def _unwrapped_for_generation(trainer: Any) -> Iterator[Any]:
    """The model without DDP / DeepSpeed wrappers; under ZeRO-3, TRL's context, which gathers the weights (with
    checkpointing off around it, which it would switch back on with the config's kwargs)."""
    unwrapped = unwrap_once(trainer, trainer.model_wrapped)
    if not is_zero3(trainer):
        yield unwrapped  # TRL's context would add a walk of the model to switch checkpointing off and on, for nothing
        return
    with checkpointing_off(unwrapped), unwrap_model_for_generation(
        trainer.model_wrapped, trainer.accelerator, generation_kwargs=trainer.generation_kwargs
    ) as model:  # fmt: skip
        yield model


def fast_generate(
    trainer: Any,
    prompt_ids: Any,
    images: Any,
    multimodal_fields: dict[str, Any],
    has_tool_images: bool = False,
    mode: str = "train",
) -> tuple[list[list[int]], list[list[float]]] | None:
    """`(completion_ids, sampler log-probs)` from the fast generator, or None when TRL's path must serve this call
    (the reason logged once per run). With tools, each call's prefilled tokens and the rows that continued the
    previous turn's cache are logged under `mode`'s metrics (`fast_generation/prefill_tokens`,
    `fast_generation/appended_rows`)."""
    generator = trainer.fast_generator
    if getattr(generator, "turns_step", None) != trainer.state.global_step:  # new weights: no turn continues a cache
        generator.turns.forget()
        generator.turns_step = trainer.state.global_step
    stats = generator.stats
    before = (stats["prefill_tokens"], stats["appended_rows"])
    out = _fast_generate(trainer, prompt_ids, images, multimodal_fields, has_tool_images)
    if out is not None and _has_tools(trainer):
        metrics = trainer._metrics[mode]
        metrics["fast_generation/prefill_tokens"].append(float(stats["prefill_tokens"] - before[0]))
        metrics["fast_generation/appended_rows"].append(float(stats["appended_rows"] - before[1]))
    return out


def _fast_generate(
    trainer: Any, prompt_ids: Any, images: Any, multimodal_fields: dict[str, Any], has_tool_images: bool
) -> tuple[list[list[int]], list[list[float]]] | None:
    if not getattr(trainer.args, "fast_generation", False) or trainer.args.use_vllm:
        return None  # vLLM asked for: TRL's path serves it (`engine.vllm_rollouts`), nothing to say
    reason = generation_blocker(trainer)
    if reason is None and has_tool_images:
        multimodal_fields = tool_image_token_types(trainer, prompt_ids, multimodal_fields)
    copy = getattr(trainer, "generation_copy", None)
    if reason is None and copy is not None and copy.model is not None:
        # FSDP2 with an unsharded copy: its trainable weights refreshed once per step, then generation as on one GPU.
        model = copy.refreshed(trainer.model_wrapped, trainer.state.global_step)
        # A base the copy shares with the model is restored before training reads it, never deferred.
        defer = not (trainer.args.torch_compile or copy.shares_weights)
        try:
            return trainer.fast_generator.generate(
                model, prompt_ids, images, multimodal_fields, trainer.generation_config,
                trainer._tokenizer.pad_token_id, defer_restore=defer, return_logprobs=True,
            )  # fmt: skip
        except FastPathUnavailable as error:
            reason = str(error)
    elif reason is None:
        # FSDP2 units are unsharded here, once for the whole rollout rather than per layer per token.
        with (
            _unwrapped_for_generation(trainer) as model,
            full_weights(trainer.model_wrapped) if trainer.is_fsdp_enabled else contextlib.nullcontext(),
        ):
            try:
                return trainer.fast_generator.generate(
                    model, prompt_ids, images, multimodal_fields, trainer.generation_config,
                    trainer._tokenizer.pad_token_id,
                    # The base weights come back while TRL's scoring forward runs (`_score_rollouts` waits for them
                    # after it); not where the weights are resharded on leaving these contexts, nor under
                    # torch_compile (Dynamo does not run the hooks that make each layer wait for its weight).
                    defer_restore=not (trainer.is_fsdp_enabled or is_zero3(trainer) or trainer.args.torch_compile),
                    return_logprobs=True,
                )  # fmt: skip
            except FastPathUnavailable as error:
                reason = str(error)
    if reason not in trainer._fast_generation_fallbacks:  # say it once per reason, not every step
        trainer._fast_generation_fallbacks.add(reason)
        logger.warning("Fast generation is off for this batch (%s); using TRL's model.generate.", reason)
    return None
